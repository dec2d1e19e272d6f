"""Evidently drift snapshots written to a real Evidently workspace (the folder `evidently ui` reads)."""

import numpy as np

from tailguard.monitoring import testing as T
from tailguard.monitoring.config import resolve_config
from tailguard.monitoring.drift import DriftSnapshots
from tailguard.spec import parse_spec


def test_drift_writes_input_and_output_snapshots_per_window_when_workspace_set(tmp_path):
    T.requests_frame(200, seed=0).to_parquet(tmp_path / "calib.parquet")
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "evidently_workspace": str(tmp_path / "ws"),
                                   "snapshot_every": 60}, data_uri=str(tmp_path / "calib.parquet")))
    snaps = DriftSnapshots(resolve_config(spec), background=False)
    rng = np.random.default_rng(1)
    w = T.weights()
    for i in range(130):
        x = rng.normal(loc=2.0, size=4).astype(np.float32)  # shifted inputs: input drift vs the calibration set
        ref = x @ w
        snaps.add({"inputs": {"x": x}, "meta": {"domain": "web"}, "reference": ref, "candidate": ref + 0.01})
    assert snaps.windows == 2 and len(snaps.written) == 2  # 130 rows: two full windows of 60
    entry = snaps.written[0]
    assert entry["input_snapshot"] and entry["output_snapshot"]
    assert entry["input_drift_share"] > 0  # the mean shift of x is seen
    from evidently.ui.workspace import Workspace

    ws = Workspace(str(tmp_path / "ws"))
    (project,) = [p for p in ws.list_projects() if p.name == "tailguard-monitor"]
    assert len(ws.list_runs(project.id)) == 4
