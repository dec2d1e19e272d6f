"""A local re-run whose only change is in `gates` or `promotion`: find the earlier run it can decide on again.

`tailguard run` keeps, for each local run that finished (register-and-promote returned a summary), a record in
$TAILGUARD_HOME/runs/<run>/rerun.json (`write_record`): the spec without `gates` and `promotion` (canonical JSON),
the reference version and SHA-256 it ran on, the data files' content hashes, tailguard's code hash, the node's facts,
the batch sizes a speed gate reads the reference pass's baselines at, and the tracking URI; beside it,
`validations/<variant>.json` holds what each validate task read (components/validate/run_log.py
`write_validation_record`). A new run of a spec that differs from such a run's only
in `gates` and/or `promotion`, on the same reference version, data bytes, code and node (`earlier_run`), is decided
in one task on the earlier run's stored measurements (components/redecide); anything else, or any doubt, runs the
whole pipeline.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tailguard.core.contract import VALIDATIONS_DIR
from tailguard.core.spec.reads import DECIDE
from tailguard.core.spec.root import Spec

RECORD_FILE = "rerun.json"
RECORD_FORMAT = 2  # 2: + baseline_gates
REDECIDED_SECTIONS = DECIDE.paths  # what a re-decide may differ in: what only the decision reads


def spec_rest_sha256(spec: Spec) -> str:
    """Hex SHA-256 of the spec's canonical JSON (`model_dump(mode="json")`, keys sorted) without `gates` and
    `promotion`: two specs with the same value differ at most in those two sections."""
    doc = spec.model_dump(mode="json")
    for key in REDECIDED_SECTIONS:
        doc.pop(key, None)
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def identity(spec: Spec, tracking_uri: str) -> dict[str, Any] | None:
    """What must be equal between an earlier run and a new one for a re-decide, apart from the reference
    version: the spec without gates and promotion, the tracking URI, the data files' content hashes
    (`cache.dataset_parts`), tailguard's code (`cache.code_sha256`), the node (`hardware.node_facts`) and the
    batch sizes a speed gate reads reference-pass's baselines at (`reference.logic.timing_gates_key`: they set
    how long those baselines are timed, so a change there is measured again).
    None when a data file cannot be hashed (a remote URI): no re-decide then."""
    from tailguard.components.reference.logic import timing_gates_key
    from tailguard.core.cache import code_sha256, dataset_parts
    from tailguard.core.hardware import node_facts

    data = {"validation": dataset_parts(spec.data.validation), "calibration": dataset_parts(spec.data.calibration)}
    if data["validation"] is None or data["calibration"] is None:
        return None
    return {"format": RECORD_FORMAT, "spec": spec_rest_sha256(spec), "tracking_uri": tracking_uri, "data": data,
            "code": code_sha256(), "node": node_facts(), "baseline_gates": timing_gates_key(spec)}


def write_record(run_dir: Path, spec: Spec, tracking_uri: str, *, pipeline_run: str, version: str,
                 sha256: str | None) -> None:
    """Keep a finished local run's `identity` with the reference version and SHA-256 it ran on, in
    `run_dir`/rerun.json (nothing when the identity cannot be known). Best effort: an OSError is ignored (the
    next run is then a full one)."""
    ident = identity(spec, tracking_uri)
    if ident is None or not sha256:
        return
    try:
        (run_dir / RECORD_FILE).write_text(json.dumps({**ident, "pipeline_run": pipeline_run,
                                                       "version": str(version), "sha256": sha256},
                                                      default=str))
    except OSError:
        pass


def registry_version(spec: Spec, tracking_uri: str, model_version: str | None) -> tuple[str, str | None]:
    """The concrete reference version the run would resolve (`reference.resolve_version`: "latest", a number or
    "@alias") and its registry tag tailguard.sha256 (None when untagged). Raises what resolve_version raises."""
    from mlflow import MlflowClient

    from tailguard.core.contract import SHA256_TAG
    from tailguard.core.reference import resolve_version

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=spec.mlflow.registry_uri or tracking_uri)
    mv = resolve_version(client, spec.model.registered_name, model_version or spec.model.version)
    return str(mv.version), (mv.tags or {}).get(SHA256_TAG)


def earlier_run(spec: Spec, tracking_uri: str, model_version: str | None, runs_dir: Path
                ) -> tuple[dict[str, Any] | None, str]:
    """The newest earlier local run in `runs_dir` this run may be decided on again, or why none.

    None at once for a spec the redecide task never decides (`redecide.logic.spec_reasons`: a search,
    serving targets, a gate on peak_rss_mb). Equal: `identity` (spec but gates and promotion, tracking URI, data
    bytes, code, node, the speed gates' baseline batch sizes) and the reference version and SHA-256 (the
    registry's tag; the redecide task checks the downloaded file's SHA-256 again); and every variant of the spec
    has its validation record.

    Returns:
        ({"pipeline_run", "version", "sha256", "validations": {variant: record}}, "") or (None, the reason).
    """
    from tailguard.components.redecide.logic import spec_reasons

    if why := spec_reasons(spec):  # never re-decided: no task is started for it
        return None, why
    records = sorted((p for p in runs_dir.glob(f"*/{RECORD_FILE}") if p.is_file()),
                        key=lambda p: p.stat().st_mtime, reverse=True)
    if not records:  # a first run: nothing to hash the data for
        return None, "no earlier finished run differs from this one only in gates or promotion"
    ident = identity(spec, tracking_uri)
    if ident is None:
        return None, "a data file is remote (its bytes cannot be compared)"
    match = None
    for path in records:
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if all(rec.get(k) == v for k, v in json.loads(json.dumps(ident, default=str)).items()):
            match = (path.parent, rec)
            break
    if match is None:
        return None, "no earlier finished run differs from this one only in gates or promotion"
    folder, rec = match
    try:
        version, tag = registry_version(spec, tracking_uri, model_version)
    except Exception as exc:  # noqa: BLE001 - the full pipeline reports a bad version properly
        return None, f"the reference version could not be resolved here ({type(exc).__name__})"
    if version != rec.get("version") or (tag is not None and tag != rec.get("sha256")):
        return None, f"the reference is version {version}, the earlier run {rec.get('pipeline_run')} ran on " \
                     f"version {rec.get('version')}"
    validations = {}
    for v in spec.variants:
        try:
            validations[v.name] = json.loads((folder / VALIDATIONS_DIR / f"{v.name}.json").read_text())
        except (OSError, ValueError):
            return None, f"run {rec.get('pipeline_run')} kept no validation of variant {v.name!r}"
    return {"pipeline_run": rec["pipeline_run"], "version": rec["version"], "sha256": rec["sha256"],
            "validations": validations}, ""
