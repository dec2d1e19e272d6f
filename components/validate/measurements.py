"""A variant's stored measurements (issue 25, item 4): the outputs of the rows scored and the timing rounds,
which do not depend on its gates, and their store in the local cache (`tailguard run`), keyed on what they are a
function of (`measurement_parts`) and checked against the digest stored with them (`load_measurements`).

The validate step, the search step's trials and the gate-only re-run (components/redecide) load them here and
hand them to `logic.validate_variant(measurements=)`.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tailguard.core.taskio import json_default

if TYPE_CHECKING:
    from tailguard.core.spec.root import Spec
    from tailguard.core.spec.variants import VariantSpec


@dataclass
class Measurements:
    """A variant's measurements that do not depend on its gates (issue 25, item 4): the outputs of the rows scored
    and the timing rounds. The validate step keys them on the variant's model bytes, the data, the benchmark
    section and the node (`measurement_parts` below), so a re-run whose only change is in
    `gates` or `promotion` decides on them again (`validate_variant(measurements=)`) instead of measuring again:
    the stopping rules are replayed on the stored rows and rounds and give what a fresh run would on the same
    ones; more rows or rounds are measured only when the new gates need them.

    Attributes:
        order: int64 (rows scored,): validation rows in the order scored (a prefix of the seeded permutation;
            0..rows-1 when sequential validation is off).
        block_sizes: rows per scored block, summing to order.size.
        outputs: the variant's first output for `order`, (rows scored, ...).
        exact_outputs: the exact-accumulation pass (numerics check) for the first rows of `order`, or None.
        timing: {runner name: {batch size: the `interleaved_benchmark` row (samples_ms included)}}, or None.
        changed: set when validation measured something new (the caller stores it again).
        discarded: why a stored entry was found but not used (its content no longer matches the digest stored
            with it: changed after it was stored), else None; the measurements are then empty.
    """

    order: np.ndarray | None = None
    block_sizes: list[int] = field(default_factory=list)
    outputs: np.ndarray | None = None
    exact_outputs: np.ndarray | None = None
    timing: dict[str, dict[int, dict[str, Any]]] | None = None
    changed: bool = False
    discarded: str | None = None

    def blocks(self) -> list[np.ndarray]:
        """`order` split into its scored blocks."""
        if self.order is None:
            return []
        return list(np.split(self.order, np.cumsum(self.block_sizes)[:-1])) if self.block_sizes else []


MEASUREMENTS_STEP = "validate-measurements"  # the local cache's step name of a variant's stored measurements


MEASUREMENTS_NPZ, TIMING_JSON = "measurements.npz", "timing.json"


def measurement_parts(spec: Spec, variant: VariantSpec, model_file: Path,
                      reference_model_dir: str | Path | None) -> dict[str, Any] | None:
    """What a variant's measurements (its outputs on the validation rows and its timing rounds, `Measurements`)
    are a function of, for the local cache key: the variant's model bytes, its execution provider and the threads,
    the FP32 baseline model it is timed against, the validation rows (bytes and section), the model's inputs,
    outputs and pad values, the `benchmark` section, the row order and blocks (`analysis.sequential` seed,
    block_rows, enabled) and the node (`tailguard.core.hardware.node_facts`: CPU model, ISA flags, cores, library
    versions). Not the gates nor promotion: a re-run that changes only those decides on the stored measurements.

    Returns:
        The parts, or None when the validation file cannot be hashed (a remote URI): then nothing is cached.
    """
    from tailguard.core.cache import dataset_parts
    from tailguard.core.contract import ONNX_FILE
    from tailguard.core.digests import dir_sha256, file_sha256
    from tailguard.core.hardware import node_facts

    validation = dataset_parts(spec.data.validation)
    if validation is None:
        return None
    seq = spec.analysis.sequential
    return {"variant_model": file_sha256(model_file), "execution_provider": variant.execution_provider,
            "threads": spec.benchmark.intra_op_num_threads,
            "baseline_model": dir_sha256(reference_model_dir, prefix=ONNX_FILE) if reference_model_dir else None,
            "validation": validation,
            "model": spec.model.model_dump(mode="json", include={"inputs", "outputs", "pad_values", "task"}),
            "benchmark": spec.benchmark.model_dump(mode="json"),
            "order": {"enabled": seq.enabled, "seed": seq.seed, "block_rows": seq.block_rows},
            "node": node_facts()}


MEASUREMENTS_DIGEST = "content_sha256"  # the entry's result.json field: digest of measurements.npz and timing.json


def measurements_digest(files: Path) -> str:
    """Hex SHA-256 over the stored measurement files (`MEASUREMENTS_NPZ`, `TIMING_JSON`: names and bytes) in
    `files` (`tailguard.core.digests.files_sha256`)."""
    from tailguard.core.digests import files_sha256

    return files_sha256([files / MEASUREMENTS_NPZ, files / TIMING_JSON], files)


def load_measurements(spec: Spec, variant: VariantSpec, model_file: Path,
                      reference_model_dir: str | Path | None) -> tuple[Any, Any]:
    """The variant's stored measurements from the local cache and the function that stores them again.

    The entry carries the digest of its files (`measurements_digest`, stored in its result as
    `MEASUREMENTS_DIGEST`), checked here before anything is read: an entry whose files changed after they were
    stored (an edited outputs array, a truncated copy) or that has no digest is not used, and says so on stderr;
    the returned Measurements is then empty with `discarded` set, so a validation measures again and a gate-only
    re-run falls back to a full run instead of deciding on it.

    Returns:
        (Measurements, save) when the cache is on (`tailguard run`, tailguard.core.cache.enabled) and the inputs can
        be hashed: an empty Measurements on a miss; save(measurements) stores it (replacing the entry) when its
        `changed` is set. (None, a no-op) otherwise.
    """
    from tailguard.core import cache

    if not cache.enabled():
        return None, lambda m: None
    parts = measurement_parts(spec, variant, model_file, reference_model_dir)
    if parts is None:
        return None, lambda m: None
    key = cache.cache_key(MEASUREMENTS_STEP, parts)
    m = Measurements()
    entry = cache.lookup(key)
    if entry is not None:
        try:
            files = Path(entry.path) / "files"
            stored = json.loads((Path(entry.path) / "result.json").read_text()).get(MEASUREMENTS_DIGEST)
            if stored != measurements_digest(files):
                m.discarded = (f"its stored measurements (cache entry {entry.key[:12]}) do not match the digest "
                               f"stored with them{'' if stored else ' (none stored)'}: changed after they were "
                               "stored, so they are not used")
                print(f"tailguard: variant {variant.name}: {m.discarded}; measuring again", file=sys.stderr,
                      flush=True)
                return m, save_fn(key, variant)
            with np.load(files / MEASUREMENTS_NPZ) as z:
                m.order, m.outputs = z["order"], z["outputs"]
                m.block_sizes = [int(b) for b in z["block_sizes"]]
                m.exact_outputs = z["exact_outputs"] if "exact_outputs" in z.files else None
            raw = json.loads((files / TIMING_JSON).read_text())
            m.timing = {n: {int(bs): row for bs, row in rows.items()} for n, rows in raw.items()} or None
        except (OSError, ValueError, KeyError):  # pruned or replaced while read: measure again
            m = Measurements()
    return m, save_fn(key, variant)


def save_fn(key: str, variant: VariantSpec) -> Any:
    """The function that stores a variant's measurements under `key` with their digest (`load_measurements`)."""
    from tailguard.core import cache

    def save(meas: Any) -> None:
        if meas is None or not meas.changed or meas.order is None:
            return
        with tempfile.TemporaryDirectory(prefix="tailguard-measurements-") as tmp:
            arrays = {"order": meas.order, "outputs": meas.outputs,
                      "block_sizes": np.asarray(meas.block_sizes, dtype=np.int64)}
            if meas.exact_outputs is not None:
                arrays["exact_outputs"] = meas.exact_outputs
            np.savez(Path(tmp) / MEASUREMENTS_NPZ, **arrays)
            timing = {n: {str(bs): row for bs, row in rows.items()} for n, rows in (meas.timing or {}).items()}
            Path(tmp, TIMING_JSON).write_text(json.dumps(timing, default=json_default))
            try:
                cache.store(key, tmp, {MEASUREMENTS_DIGEST: measurements_digest(Path(tmp)),
                                       "rows_scored": int(meas.order.size),
                                       "timed_batch_sizes": sorted({int(bs) for rows in (meas.timing or {}).values()
                                                                    for bs in rows})},
                            step=MEASUREMENTS_STEP, label=f"measurements {variant.name}", replace=True)
                cache.prune()
            except OSError:  # a full disk must not fail the validation: the result is still good
                pass

    return save
