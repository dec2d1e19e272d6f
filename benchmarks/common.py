"""Shared set-up of the MiniLM benchmarks (bench_minilm.py, bench_search.py): a TAILGUARD_HOME, the WordNet data,
the demo spec and the registered MiniLM, plus the small helpers their JSON reports use."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any


def prepare_minilm(home_dir: Path, **data_kwargs: Any) -> tuple[Path, dict[str, Path]]:
    """Point TAILGUARD_HOME at `home_dir`, write the WordNet datasets (`build_wordnet_datasets(**data_kwargs)`) and
    the demo spec into <home>/bench.

    Returns:
        (spec path, {"validation": path, "calibration": path, "traffic": path}).
    """
    os.environ["TAILGUARD_HOME"] = str(Path(home_dir).resolve())
    from tailguard.core.home import home, quiet_environment
    from tailguard.demo.data import build_wordnet_datasets
    from tailguard.demo.run import write_demo_spec

    quiet_environment()
    work = home() / "bench"
    work.mkdir(parents=True, exist_ok=True)
    data = build_wordnet_datasets(work / "data", **data_kwargs)
    return write_demo_spec(work, data), data


def ratio(base: float | None, value: float | None) -> float | None:
    """base / value rounded to 3 decimals (> 1: faster than the baseline); None when either is missing."""
    return round(base / value, 3) if base and value else None


def version(pkg: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def run_minilm(spec_path: Path, doc: dict[str, Any]) -> tuple[Any, str, Any, Any, dict[str, float]]:
    """Write `doc` (the edited demo spec) to `spec_path`, register MiniLM as a new version and run the pipeline
    with kfp.local in one call.

    Returns:
        (spec, registered version, RunSummary, MlflowClient on the run's store, the parent run's metrics).
    """
    import mlflow
    import yaml

    from tailguard.core.spec import load_spec
    from tailguard.core.tracking import tracking_uri_for
    from tailguard.demo.run import register_demo_model
    from tailguard.runner import run_local

    spec_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    spec = load_spec(spec_path)
    uri = tracking_uri_for(spec)
    version = register_demo_model(uri)
    summary = run_local(spec, model_version=version).summary
    client = mlflow.MlflowClient(uri)
    return spec, version, summary, client, client.get_run(summary.parent_run_id).data.metrics


def report_header(name: str, threads: int, packages: tuple[str, ...]) -> dict[str, Any]:
    """The fields every benchmark JSON starts with: name, command line, machine, the node's hardware facts
    (`tailguard.core.hardware.node_facts`: CPU model, kernel ISA flags such as avx512_vnni, cores, GPUs, library
    versions), package versions."""
    from tailguard.core.hardware import node_facts

    return {"benchmark": name, "command": " ".join([sys.executable, *sys.argv]),
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "cpus": os.cpu_count(), "threads": threads},
            "hardware": node_facts(),
            "packages": {p: version(p) for p in packages}}
