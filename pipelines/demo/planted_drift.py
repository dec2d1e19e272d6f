"""The demo's monitor stage: replay logged traffic against the promoted variant with a PLANTED drift.

Application layer (it drives the monitor's replay; the monitor never imports it).

The drift is artificial, made by this module, not by the model: for rows of one (rare) slice in the last part of
the replayed traffic, the candidate's outputs are perturbed after inference (classification: top-1 and top-2
logits swapped with probability `drift_rate`; embedding: the vector mixed with noise; regression/generic: an
offset added). The monitor sees only the perturbed outputs and must find the slice on its own.

With `bare=True` the replayed requests are the tensors alone (every metadata column dropped, as a production client
sends them): the drift is planted in a metadata slice the monitor cannot see, and must be caught by a derived slice
(`topic`: the nearest centroid of the reference embedding; `n_tokens` from the attention mask; issue 35).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tailguard.core.errors import InputError
from tailguard.core.spec import load_spec
from tailguard.core.spec.root import Spec
from tailguard.monitoring.config import resolve_config
from tailguard.monitoring.replay import replay
from tailguard.monitoring.testing import flip_top1


def perturb_outputs(model_task: str, outputs: np.ndarray, mask: np.ndarray, rate: float, seed: int = 0) -> np.ndarray:
    """Planted drift for the rows under `mask` (see module docstring).

    Args:
        model_task: model.task.
        outputs: (rows, ...) candidate outputs.
        mask: (rows,) bool, rows to perturb.
        rate: classification: flip probability; embedding: noise mix weight (0..1); regression: offset in units
            of the output's standard deviation.
        seed: RNG seed.

    Returns:
        Perturbed copy, same shape and dtype.
    """
    if model_task == "classification":
        return flip_top1(outputs, mask, rate, seed)
    out = np.array(outputs, copy=True)
    rng = np.random.default_rng(seed)
    if model_task == "embedding":
        noise = rng.normal(size=out[mask].shape).astype(out.dtype)
        norm = np.linalg.norm(out[mask], axis=1, keepdims=True) / max(np.sqrt(out.shape[1]), 1.0)
        out[mask] = (1 - rate) * out[mask] + rate * noise * norm
    else:
        out[mask] = out[mask] + rate * (float(np.std(out)) or 1.0)
    return out


def replay_with_drift(spec: Spec | str | Path, reference_onnx: str | Path, candidate_onnx: str | Path,
                      requests_parquet: str | Path, out_dir: str | Path, *, drift_slice: tuple[str, Any],
                      drift_start: float = 0.5, drift_rate: float = 0.3, seed: int = 0,
                      monitoring_overrides: dict[str, Any] | None = None, bare: bool = False,
                      centroids: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Replay requests through the monitor with a planted drift in one slice; return the alerts.

    Args:
        spec: Spec or spec path (needs a monitoring section unless `monitoring_overrides` gives sample_rate).
        reference_onnx: FP32 reference .onnx.
        candidate_onnx: the promoted variant's .onnx.
        requests_parquet: logged requests (input columns + metadata columns).
        out_dir: output folder for alerts.json / slices.json.
        drift_slice: (metadata column, value): rows with frame[column] == value are perturbed.
        drift_start: the drift covers rows from this fraction of the file to its end (0..1).
        drift_rate: strength (see `perturb_outputs`).
        seed: sampler and perturbation seed.
        monitoring_overrides: fields merged into the spec's monitoring section (e.g. a higher sample_rate so a
            short demo file gives the rare slice enough support).
        bare: replay the input tensors only (the metadata columns dropped): only derived slices can see the drift.
        centroids: {slice name: (k, dim)} for nearest_centroid slices (the validate run's centroids.npz).

    Returns:
        The `replay` result plus "drift": {"column", "value", "start_row", "rate", "rows_perturbed",
        "planted": True, "bare"} and "detected": whether an alert fired on a slice key of the drifted column (bare:
        on a derived slice).

    Raises:
        InputError: the drift column is not in the requests or `drift_start` is outside [0, 1].
        SpecError: invalid monitoring settings.
    """
    spec_obj = load_spec(spec) if not isinstance(spec, Spec) else spec
    if monitoring_overrides:
        mon = spec_obj.monitoring.model_dump() if spec_obj.monitoring else {}
        mon.update(monitoring_overrides)
        data = spec_obj.model_dump(mode="json")
        data["monitoring"] = mon
        spec_obj = Spec.model_validate(data)
    if not 0 <= drift_start <= 1:
        raise InputError(f"drift_start must be in [0, 1], got {drift_start}")
    column, value = drift_slice
    frame = pd.read_parquet(requests_parquet, columns=None)
    if column not in frame.columns:
        raise InputError(f"drift_slice: requests {requests_parquet} have no column {column!r}")
    start_row = int(round(drift_start * len(frame)))
    drift_mask_all = (frame[column].astype(str).to_numpy() == str(value)) & (np.arange(len(frame)) >= start_row)
    counted: dict[str, int] = {"rows": 0}

    def perturb(cand: np.ndarray, idx: np.ndarray, _frame: pd.DataFrame) -> np.ndarray:
        mask = drift_mask_all[idx]
        counted["rows"] = int(mask.sum())
        return perturb_outputs(spec_obj.model.task, cand, mask, drift_rate, seed)

    replayed = requests_parquet
    if bare:  # what a production client sends: the tensors, no metadata
        replayed = Path(out_dir) / "bare_requests.parquet"
        replayed.parent.mkdir(parents=True, exist_ok=True)
        frame[[t.name for t in spec_obj.model.inputs]].to_parquet(replayed)
    result = replay(spec_obj, reference_onnx, candidate_onnx, replayed, out_dir, seed=seed, perturb=perturb,
                    centroids=centroids)
    cfg = resolve_config(spec_obj, centroids=centroids)
    rule_names = {r.name for r in cfg.rules if (r.derived if bare else r.column == column)}
    result["drift"] = {"column": column, "value": value, "start_row": start_row, "rate": drift_rate,
                       "rows_in_drift": int(drift_mask_all.sum()), "sampled_rows_perturbed": counted["rows"],
                       "planted": True, "bare": bare}
    result["detected"] = any(a["slice"].split("=", 1)[0] in rule_names for a in result["alerts"])
    return result
