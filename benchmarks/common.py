"""Shared set-up of the MiniLM benchmarks (bench_minilm.py, bench_search.py): a TAILGUARD_HOME, the WordNet data,
the demo spec and the registered MiniLM, plus the small helpers their JSON reports use."""

from __future__ import annotations

import os
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
    from tailguard.demo import write_demo_spec
    from tailguard.demo_data import build_wordnet_datasets
    from tailguard.home import home, quiet_environment

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
