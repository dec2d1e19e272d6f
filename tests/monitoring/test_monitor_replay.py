"""Offline replay (`tailguard monitor replay`) and the demo's planted-drift replay, on tiny real ONNX models."""

import json

import pytest
import yaml

from tailguard.core.errors import InputError, SpecError
from tailguard.core.spec import parse_spec
from tailguard.demo.planted_drift import replay_with_drift
from tailguard.monitoring import testing as T
from tailguard.monitoring.replay import replay, replay_cli

MON = {"sample_rate": 0.1, "window_size": 400, "min_support": 30, "horizon": 10_000}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    T.requests_frame(12000, seed=1, rare_share=0.02).to_parquet(d / "data.parquet")
    T.linear_classifier(d / "ref.onnx")
    T.linear_classifier(d / "cand.onnx", T.weights(noise=0.02))  # ~98.5% top-1 agreement
    T.linear_classifier(d / "bad.onnx", T.weights(noise=1.0, seed=5))  # a badly broken candidate
    (d / "spec.yaml").write_text(yaml.safe_dump(T.spec_dict(MON)))
    return d


def _load(out):
    return json.loads((out / "alerts.json").read_text()), json.loads((out / "slices.json").read_text())


def test_replay_exits_0_and_writes_slices_when_candidate_is_close(files, tmp_path):
    code = replay_cli(files / "spec.yaml", files / "ref.onnx", files / "cand.onnx", files / "data.parquet", tmp_path)
    alerts, slices = _load(tmp_path)
    assert code == 0 and alerts == []
    # the declared slice, and the reference's top-1 class tracked by default (issue 35)
    assert set(slices["slices"]) == {"all", "domain=legal", "domain=news", "domain=web", "predicted=0",
                                     "predicted=1", "predicted=2"}
    legal = slices["slices"]["domain=legal"]
    assert legal["metrics"]["top1_agree"]["status"] in ("ok", "insufficient_data")
    # rare slice oversampled: its share of sampled rows exceeds its traffic share
    assert legal["samples_total"] / slices["sampled"] > 2 * legal["traffic_share"]


def test_replay_exits_4_with_request_index_when_candidate_is_broken(files, tmp_path):
    code = replay_cli(files / "spec.yaml", files / "ref.onnx", files / "bad.onnx", files / "data.parquet", tmp_path)
    alerts, _ = _load(tmp_path)
    assert code == 4 and alerts
    assert all(isinstance(a["request_index"], int) and 0 <= a["request_index"] < 12000 for a in alerts)
    assert {"slice", "metric", "value", "threshold", "samples_seen", "method", "fired_at"} <= set(alerts[0])


def test_replay_outputs_equal_when_seed_equal(files, tmp_path):
    spec = parse_spec(T.spec_dict(MON, data_uri=str(files / "data.parquet")))
    runs = [replay(spec, files / "ref.onnx", files / "bad.onnx", files / "data.parquet", tmp_path / str(i), seed=s)
            for i, s in enumerate((7, 7, 8))]
    strip = [[{k: v for k, v in a.items() if k != "fired_at"} for a in r["alerts"]] for r in runs]
    assert strip[0] == strip[1] and runs[0]["slices"] == runs[1]["slices"]
    assert runs[0]["sampled"] != runs[2]["sampled"] or strip[0] != strip[2]


def test_replay_never_alerts_when_noise_floor_over_many_requests(files, tmp_path):
    spec = parse_spec(T.spec_dict({**MON, "noise_floor": True, "sample_rate": 1.0}))
    r = replay(spec, files / "ref.onnx", files / "bad.onnx", files / "data.parquet", tmp_path)
    assert r["exit_code"] == 0 and r["alerts"] == [] and r["sampled"] == 12000
    assert r["slices"]["slices"]["all"]["metrics"]["top1_agree"]["mean"] == 1.0


def test_replay_raises_input_error_when_requests_file_missing(files, tmp_path):
    with pytest.raises(InputError) as e:
        replay_cli(files / "spec.yaml", files / "ref.onnx", files / "cand.onnx", tmp_path / "nope.parquet", tmp_path)
    assert e.value.exit_code == 2 and "--requests" in str(e.value)


def test_replay_raises_input_error_when_slice_column_missing(files, tmp_path):
    T.requests_frame(50).drop(columns=["domain"]).to_parquet(tmp_path / "r.parquet")
    with pytest.raises(InputError) as e:
        replay_cli(files / "spec.yaml", files / "ref.onnx", files / "cand.onnx", tmp_path / "r.parquet", tmp_path)
    assert e.value.exit_code == 2 and "domain" in str(e.value)


def test_replay_raises_spec_error_when_monitoring_section_missing(files, tmp_path):
    d = T.spec_dict()
    del d["monitoring"]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(SpecError) as e:
        replay_cli(tmp_path / "s.yaml", files / "ref.onnx", files / "cand.onnx", files / "data.parquet", tmp_path)
    assert e.value.exit_code == 2 and e.value.errors[0].loc == "monitoring"


def test_replay_raises_input_error_when_onnx_file_corrupt(files, tmp_path):
    (tmp_path / "x.onnx").write_bytes(b"not onnx")
    with pytest.raises(InputError) as e:
        replay_cli(files / "spec.yaml", tmp_path / "x.onnx", files / "cand.onnx", files / "data.parquet", tmp_path)
    assert e.value.exit_code == 2


def test_demo_replay_detects_planted_drift_when_rare_slice_drifts(files, tmp_path):
    r = replay_with_drift(files / "spec.yaml", files / "ref.onnx", files / "cand.onnx", files / "data.parquet",
                          tmp_path, drift_slice=("domain", "legal"), drift_start=0.5, drift_rate=0.4)
    assert r["drift"]["planted"] and r["drift"]["sampled_rows_perturbed"] > 0
    assert r["detected"] and r["exit_code"] == 4
    legal = [a for a in r["alerts"] if a["slice"] == "domain=legal"]
    assert legal and legal[0]["request_index"] >= r["drift"]["start_row"]
    assert not [a for a in r["alerts"] if a["slice"] in ("domain=news", "domain=web")]


# ------------------------------------------------------------------------------ what the replay prints
def _consoles(width=200):
    import io

    from rich.console import Console

    return (Console(file=io.StringIO(), width=width, highlight=False, color_system=None),
            Console(file=io.StringIO(), width=width, highlight=False, color_system=None))


def test_replay_cli_prints_one_line_per_alert_and_a_table_and_logs_none_when_alerts_fire(files, tmp_path, caplog):
    out, err = _consoles()
    with caplog.at_level("INFO", logger="tailguard.monitoring"):
        code = replay_cli(files / "spec.yaml", files / "ref.onnx", files / "bad.onnx", files / "data.parquet",
                          tmp_path, console=out, err_console=err)
    alerts, _ = _load(tmp_path)
    text = out.file.getvalue()
    lines = [line for line in text.splitlines() if line.startswith("ALERT ")]
    assert code == 4 and len(lines) == len(alerts) > 0
    assert not [r for r in caplog.records if r.getMessage().startswith("alert fired")]  # printed once, not logged
    for a, line in zip(alerts, lines):
        assert line.startswith(f"ALERT {a['slice']} {a['metric']} ") and f"at request {a['request_index']}" in line
    table = text[text.index(f"{len(alerts)} alert"):]
    assert all(h in table for h in ("slice", "metric", "value", "threshold", "fired at request"))
    assert all(f"│ {a['slice']} " in table and str(a["request_index"]) in table for a in alerts)
    assert err.file.getvalue() == "" and "json" not in text.lower().replace("alerts.json", "").replace(
        "slices.json", "")


def test_replay_cli_writes_the_same_alerts_json_when_it_prints(files, tmp_path):
    quiet = replay_cli(files / "spec.yaml", files / "ref.onnx", files / "bad.onnx", files / "data.parquet",
                       tmp_path / "a")
    out, err = _consoles()
    loud = replay_cli(files / "spec.yaml", files / "ref.onnx", files / "bad.onnx", files / "data.parquet",
                      tmp_path / "b", console=out, err_console=err)
    def strip(p):
        return [{k: v for k, v in a.items() if k != "fired_at"} for a in _load(p)[0]]
    assert quiet == loud == 4 and strip(tmp_path / "a") == strip(tmp_path / "b")


@pytest.mark.parametrize("width", [80, 200])
def test_alerts_table_keeps_slice_metric_and_request_whole_when_terminal_is_narrow_or_wide(width):
    from tailguard.monitoring.replay import alerts_table

    alerts = [{"slice": "domain=legal", "metric": "top1_agree", "value": 0.5785, "threshold": 0.97,
               "direction": "min", "request_index": 6249},
              {"slice": "all", "metric": "kl_divergence", "value": 0.31, "threshold": 0.05, "direction": "max",
               "request_index": 12}]
    out, _ = _consoles(width)
    out.print(alerts_table(alerts))
    text = out.file.getvalue()
    assert all(len(line) <= width for line in text.splitlines())
    for token in ("domain=legal", "top1_agree", "kl_divergence", "0.5785", "min 0.97", "max 0.05", "6249"):
        assert token in text, (token, text)


def test_replay_cli_warns_once_on_stderr_when_reference_and_candidate_are_the_same_file(files, tmp_path):
    import shutil

    shutil.copyfile(files / "ref.onnx", tmp_path / "copy.onnx")
    out, err = _consoles()
    code = replay_cli(files / "spec.yaml", files / "ref.onnx", tmp_path / "copy.onnx", files / "data.parquet",
                      tmp_path / "o", console=out, err_console=err)
    warning = " ".join(err.file.getvalue().split())
    assert code == 0 and warning.count("same model file") == 1 and "cannot alert" in warning
    assert "same model file" not in out.file.getvalue()
    out, err = _consoles()
    replay_cli(files / "spec.yaml", files / "ref.onnx", files / "cand.onnx", files / "data.parquet", tmp_path / "p",
               console=out, err_console=err)
    assert err.file.getvalue() == ""


def test_monitor_serve_warns_on_stderr_when_reference_and_candidate_are_the_same_file(files, tmp_path):
    from typer.testing import CliRunner

    from tailguard.cli import app

    # a missing spec ends the command with exit 2 right after the warning, before any port is bound
    r = CliRunner().invoke(app, ["monitor", "serve", "--spec", str(tmp_path / "none.yaml"), "--reference",
                                 str(files / "ref.onnx"), "--candidate", str(files / "ref.onnx")])
    assert r.exit_code == 2 and " ".join(r.output.split()).count("same model file") == 1
    r = CliRunner().invoke(app, ["monitor", "serve", "--spec", str(tmp_path / "none.yaml"), "--reference",
                                 str(files / "ref.onnx"), "--candidate", str(files / "cand.onnx")])
    assert r.exit_code == 2 and "same model file" not in r.output
