"""Evidently drift snapshots written to a real Evidently workspace (the folder `evidently ui` reads)."""

import numpy as np

from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.config import resolve_config
from tailguard.monitoring.drift import DriftSnapshots


def test_drift_writes_input_and_output_snapshots_per_window_when_workspace_set(tmp_path):
    T.requests_frame(200, seed=0).to_parquet(tmp_path / "calib.parquet")
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "evidently_workspace": str(tmp_path / "ws"),
                                   "snapshot_every": 60}, data_uri=str(tmp_path / "calib.parquet")))
    snaps = DriftSnapshots(resolve_config(spec), background=False)
    rng = np.random.default_rng(1)
    w = T.weights()
    for _ in range(130):
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


def test_drift_snapshots_of_two_replays_differ_in_name_tags_and_metadata_when_written_to_one_project(tmp_path):
    T.requests_frame(200, seed=0).to_parquet(tmp_path / "calib.parquet")
    spec = parse_spec(T.spec_dict({"sample_rate": 0.1, "evidently_workspace": str(tmp_path / "ws"),
                                   "snapshot_every": 30}, data_uri=str(tmp_path / "calib.parquet")))
    rng = np.random.default_rng(1)
    rows = [rng.normal(size=4).astype(np.float32) for _ in range(30)]
    sessions = []
    for _ in range(2):  # the same requests replayed twice
        snaps = DriftSnapshots(resolve_config(spec), background=False)
        for x in rows:
            snaps.add({"inputs": {"x": x}, "meta": {"domain": "web"}, "reference": x @ T.weights(),
                       "candidate": x @ T.weights()})
        sessions.append(snaps.written[0]["session"])
    assert sessions[0] != sessions[1]
    from evidently.ui.workspace import Workspace

    ws = Workspace(str(tmp_path / "ws"))
    (project,) = [p for p in ws.list_projects() if p.name == "tailguard-monitor"]
    snapshots = [ws.get_run(project.id, r) for r in ws.list_runs(project.id)]
    labels = {(s.name, tuple(s.tags), s.metadata["session"]) for s in snapshots}
    assert len(labels) == 4  # input + output drift of window 1, per replay: no two alike
    assert {s.metadata["session"] for s in snapshots} == set(sessions)
    assert all(f"[{s.metadata['session']}]" in s.name and f"session:{s.metadata['session']}" in s.tags
               for s in snapshots)
