"""token_classification through the validate step and the shadow monitor (issue 38 item 1), on a tiny real CTC model
(tests/helpers/ctc_models.py): a candidate that corrupts one position of every row is scored by per-position
agreement, decoded exact match and cer overall, per slice and on the gates; the reference pass keeps (rows, time)
ids, not (rows, time, classes) scores; a live monitor fed the same rows scores the same per-row values; a spec that
declares a 3-D output under task classification is refused with the fix.

Real parts: ONNX models built with onnx.helper run by ONNX Runtime, the validate step's logic, the reference pass's
logic, a MonitorService served by uvicorn, httpx, the typer CLI. Nothing is mocked."""

import httpx
import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from tailguard.cli import app
from tailguard.components.reference.logic import reference_outputs
from tailguard.components.validate.logic import validate_variant
from tailguard.core.data import Dataset
from tailguard.core.errors import SpecError
from tailguard.core.runtime import OrtRunner
from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T
from tailguard.monitoring.app import build_app
from tailguard.monitoring.compare import compare_rows
from tailguard.monitoring.config import resolve_config
from tailguard.monitoring.service import MonitorService
from tests.helpers import ctc_models as C
from tests.helpers.mlflow_server import uvicorn_in_thread

N = 96  # rows = 6 requests of 16


def _doc(gates=None, decode=None, task="token_classification", shape=None):
    doc = T.spec_dict({"sample_rate": 1.0, "seed": 0, "min_support": 1}, slices=[{"name": "font", "column": "font"}])
    doc["model"].update(task=task, inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", C.TIME, C.FEAT]}],
                        outputs=[{"name": "scores", "dtype": "float32",
                                  "shape": shape or ["batch", "time", C.CLASSES]}])
    if decode is not None:
        doc["model"]["decode"] = decode
    doc["gates"] = gates or [{"metric": "cer", "max": 0.5}]
    doc["benchmark"] = {"batch_sizes": [1], "warmup": 1, "iterations": 3}
    doc["promotion"] = {"enabled": False}
    doc["analysis"] = {"sequential": {"enabled": False}, "discovery": {"enabled": False}}
    doc["data"]["validation"]["batch_size"] = 16
    return doc


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("token_validate")
    x = C.features(N)
    font = np.where(np.arange(N) % 3 == 0, "serif", "sans")
    ds = Dataset({"x": list(x)}, pd.DataFrame({"font": font}), np.full(N, C.TIME, dtype=np.int64),
                 str(d / "v.parquet"))
    return d, ds, x, font, C.reference_model(d / "ref.onnx"), C.candidate_model(d / "cand.onnx")


def test_reference_pass_keeps_per_position_ids_when_task_is_token_classification(setup):
    d, ds, x, _, ref, _ = setup
    spec = parse_spec(_doc(decode={"kind": "ctc_greedy", "blank": 0}))

    outs = reference_outputs(OrtRunner(ref), ds, spec)

    assert len(outs) == 1 and outs[0].dtype == np.int32 and outs[0].shape == (N, C.TIME)
    assert (outs[0] == C.scores(x).argmax(2)).all()


def test_validate_scores_token_agreement_exact_match_and_cer_overall_and_per_slice_when_one_position_is_corrupt(setup):
    d, ds, x, font, ref, cand = setup
    spec = parse_spec(_doc(decode={"kind": "ctc_greedy", "blank": 0},
                           gates=[{"metric": "cer", "max": 0.01},
                                  {"metric": "token_top1_agreement", "min": 0.9},
                                  {"metric": "sequence_exact_match", "scope": "per_slice", "min": 0.99,
                                   "min_support": 5}]))
    reference = reference_outputs(OrtRunner(ref), ds, spec)

    res = validate_variant(spec, "ort-fp32", OrtRunner(cand), reference, ds, d / "v")

    want = C.expected(x)
    assert 0 < want["char_error"].mean() < 0.5 and not want["sequence_exact"].all()  # the corruption shows
    assert res.overall["token_top1_agreement"] == pytest.approx(want["token_top1_agree"].mean())
    assert res.overall["sequence_exact_match"] == pytest.approx(want["sequence_exact"].mean())
    assert res.overall["cer"] == pytest.approx(want["char_error"].mean())
    assert [g.status for g in res.gates] == ["failed", "passed", "failed"]
    metrics = res.mlflow_metrics()
    serif = font == "serif"
    assert metrics["slice.font.serif.cer"] == pytest.approx(want["char_error"][serif].mean())
    assert metrics["slice.font.sans.sequence_exact_match"] == pytest.approx(want["sequence_exact"][~serif].mean())
    worst = pd.read_csv(d / "v" / "worst_samples.csv")
    assert worst["char_error"].is_monotonic_decreasing and worst["char_error"].iloc[0] == want["char_error"].max()
    # the report's key metric and the worst slice are the per-slice cer
    assert res.worst_slice["metric"] == "cer"
    assert res.worst_slice["observed"] == pytest.approx(max(want["char_error"][serif].mean(),
                                                            want["char_error"][~serif].mean()))


def test_validate_passes_every_gate_when_the_candidate_is_the_reference(setup):
    d, ds, _, _, ref, _ = setup
    spec = parse_spec(_doc(decode={"kind": "ctc_greedy", "blank": 0}, gates=[{"metric": "cer", "max": 0.0},
                                                                            {"metric": "sequence_exact_match",
                                                                             "min": 1.0}]))
    res = validate_variant(spec, "ort-fp32", OrtRunner(ref), reference_outputs(OrtRunner(ref), ds, spec), ds,
                           d / "same")

    assert res.overall == pytest.approx({**res.overall, "token_top1_agreement": 1.0, "sequence_exact_match": 1.0,
                                         "cer": 0.0})
    assert all(g.status == "passed" for g in res.gates)


def test_monitor_scores_the_same_per_row_values_as_validation_when_fed_the_same_rows(setup):
    d, ds, x, _, ref, cand = setup
    spec = parse_spec(_doc(decode={"kind": "ctc_greedy", "blank": 0}))
    svc = MonitorService(resolve_config(spec), ref, cand)
    try:
        with uvicorn_in_thread(build_app(svc)) as url:
            with httpx.Client(base_url=url, timeout=60) as client:
                for i in range(0, N, 16):
                    body = {"inputs": [{"name": "x", "shape": [16, C.TIME, C.FEAT], "datatype": "FP32",
                                        "data": x[i:i + 16].ravel().tolist()}]}
                    assert client.post("/v2/models/tiny-clf/infer", json=body).status_code == 200
                assert svc.wait_idle(60)
                doc = client.get("/v1/slices").json()
    finally:
        svc.stop()
    overall = doc["slices"]["all"]
    want = C.expected(x)
    assert overall["samples_total"] == N
    assert {"token_top1_agree", "sequence_exact", "char_error"} <= set(overall["metrics"])
    means = _means(overall)  # an exponentially weighted display mean (monitoring/detector.py): close, not equal
    assert means["char_error"] == pytest.approx(want["char_error"].mean(), abs=0.02)
    assert means["sequence_exact"] == pytest.approx(want["sequence_exact"].mean(), abs=0.02)
    # the per-row values the monitor compares, one 16-row request at a time, are validation's exactly
    for i in range(0, N, 16):
        rows = compare_rows("token_classification", C.scores(x[i:i + 16]), C.scores(x[i:i + 16], corrupt=True),
                            ["token_top1_agree", "sequence_exact", "char_error"], decode=spec.model.decode)
        for key in ("token_top1_agree", "sequence_exact", "char_error"):
            assert rows[key].tolist() == pytest.approx(want[key][i:i + 16].astype(float).tolist())


def _means(slice_doc: dict) -> dict:
    """{metric: mean} from a /v1/slices entry."""
    metrics = slice_doc.get("metrics") or {}
    return {m: v["mean"] for m, v in metrics.items() if isinstance(v, dict) and "mean" in v}


def test_spec_check_refuses_a_three_axis_output_with_the_fix_when_task_is_classification(tmp_path):
    doc = _doc(task="classification", gates=[{"metric": "top1_agreement", "min": 0.9}])
    with pytest.raises(SpecError) as info:
        parse_spec(doc)
    assert "use task: token_classification" in info.value.message
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))

    r = CliRunner().invoke(app, ["spec", "check", "--no-data", str(path)])

    assert r.exit_code == 2, r.output
    assert "model.outputs.0.shape" in r.output or "outputs.0.shape" in r.output
    assert "use task: token_classification" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("change, problem", [
    ({"decode": {"kind": "ctc_greedy", "mask_input": "attention_mask"}}, "decode.mask_input"),
    ({"decode": {"kind": "ctc_greedy", "blank": 6}}, "decode.blank"),
    ({"shape": ["batch", C.CLASSES]}, "token_classification compares (batch, time, classes)"),
])
def test_spec_refuses_token_settings_naming_the_field_when_they_do_not_fit_the_model(change, problem):
    with pytest.raises(SpecError) as info:
        parse_spec(_doc(**change))
    assert problem in info.value.message


@pytest.mark.parametrize("shape", [["batch", "time", C.CLASSES], ["batch", C.CLASSES]])
def test_register_with_spec_exits_2_naming_token_classification_when_a_ctc_model_is_declared_classification(
        setup, tmp_path, shape):
    d, *_, ref, _ = setup
    doc = _doc(task="classification", shape=shape, gates=[{"metric": "top1_agreement", "min": 0.9}])
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc))

    r = CliRunner().invoke(app, ["register", "ctc", str(ref), "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}",
                                 "--spec", str(spec)])

    assert r.exit_code == 2, r.output
    assert "outputs.0.shape" in r.output and "use task: token_classification" in r.output
    assert "Traceback" not in r.output


def test_compare_rows_takes_the_mask_from_the_request_inputs_when_decode_names_a_mask_input():
    from tailguard.core.errors import InputError
    from tailguard.core.spec.model import DecodeSpec

    x = C.features(4, seed=3)
    ref, cand = C.scores(x), C.scores(x, corrupt=True)
    mask = np.ones((4, C.TIME), dtype=np.int64)
    mask[:, C.CORRUPT_T:] = 0  # the corrupted position is padding here
    decode = DecodeSpec(kind="ctc_greedy", blank=0, mask_input="attention_mask")

    rows = compare_rows("token_classification", ref, cand, ["token_top1_agree", "char_error"], decode=decode,
                        feeds={"attention_mask": mask})

    want = C.expected(x, mask)
    assert rows["token_top1_agree"].tolist() == [1.0] * 4 and rows["char_error"].tolist() == [0.0] * 4
    assert want["char_error"].tolist() == [0.0] * 4
    with pytest.raises(InputError, match="attention_mask"):
        compare_rows("token_classification", ref, cand, ["char_error"], decode=decode, feeds={"x": x})


def test_sequential_validation_scores_token_rows_block_by_block_when_enabled(setup):
    d, ds, x, _, ref, cand = setup
    doc = _doc(decode={"kind": "ctc_greedy", "blank": 0}, gates=[{"metric": "cer", "max": 0.5}])
    doc["analysis"]["sequential"] = {"enabled": True, "block_rows": 16, "min_rows": 32, "seed": 0}
    spec = parse_spec(doc)
    reference = reference_outputs(OrtRunner(ref), ds, spec)

    res = validate_variant(spec, "ort-fp32", OrtRunner(cand), reference, ds, d / "seq")

    # the rows scored are a prefix of the seeded permutation (components/validate/logic.py score_sequentially)
    assert res.rows_used is not None and 32 <= res.rows_used <= N and res.rows_used % 16 == 0
    rows = np.random.default_rng(0).permutation(N)[:res.rows_used]
    want = C.expected(x[rows])
    assert res.overall["cer"] == pytest.approx(want["char_error"].mean())
    assert res.overall["sequence_exact_match"] == pytest.approx(want["sequence_exact"].mean())
    assert res.gates[0].status == "passed"


def test_monitor_replay_alerts_on_char_error_with_ids_kept_per_batch_when_the_candidate_corrupts_a_position(
        setup, tmp_path):
    from tailguard.monitoring.replay import replay

    d, ds, x, font, ref, cand = setup
    pd.DataFrame({"x": [r.tolist() for r in x], "font": font}).to_parquet(tmp_path / "requests.parquet")
    doc = _doc(decode={"kind": "ctc_greedy", "blank": 0})
    doc["monitoring"] = {"sample_rate": 1.0, "seed": 0, "min_support": 1, "slice_columns": ["font"],
                         "thresholds": {"char_error": {"max": 0.01}}}
    spec = parse_spec(doc)

    same = replay(spec, ref, ref, tmp_path / "requests.parquet", tmp_path / "same")
    bad = replay(spec, ref, cand, tmp_path / "requests.parquet", tmp_path / "bad")

    assert same["exit_code"] == 0 and not same["alerts"]
    assert bad["exit_code"] == 4 and {a["metric"] for a in bad["alerts"]} == {"char_error"}
    overall = bad["slices"]["slices"]["all"]
    assert overall["samples_total"] == N
    assert overall["metrics"]["char_error"]["mean"] == pytest.approx(C.expected(x)["char_error"].mean(), abs=0.03)


def test_monitor_service_masks_the_corrupt_position_per_request_when_requests_carry_the_mask_input(tmp_path):
    ref = C.reference_model(tmp_path / "ref.onnx", mask_input=True)
    cand = C.candidate_model(tmp_path / "cand.onnx", mask_input=True)
    doc = _doc(decode={"kind": "ctc_greedy", "blank": 0, "mask_input": "attention_mask"})
    doc["model"]["inputs"].append({"name": "attention_mask", "dtype": "int64", "shape": ["batch", C.TIME]})
    spec = parse_spec(doc)
    x = C.features(64, seed=5)
    mask = np.ones((64, C.TIME), dtype=np.int64)
    mask[32:, C.CORRUPT_T:] = 0  # the last two requests mask the corrupted position (and what follows)
    svc = MonitorService(resolve_config(spec), ref, cand)
    try:
        with uvicorn_in_thread(build_app(svc)) as url:
            with httpx.Client(base_url=url, timeout=60) as client:
                for i in range(0, 64, 16):
                    body = {"inputs": [{"name": "x", "shape": [16, C.TIME, C.FEAT], "datatype": "FP32",
                                        "data": x[i:i + 16].ravel().tolist()},
                                       {"name": "attention_mask", "shape": [16, C.TIME], "datatype": "INT64",
                                        "data": mask[i:i + 16].ravel().tolist()}],
                            "parameters": {"font": "serif" if i < 32 else "sans"}}
                    assert client.post("/v2/models/tiny-clf/infer", json=body).status_code == 200
                assert svc.wait_idle(60)
                doc = client.get("/v1/slices").json()
    finally:
        svc.stop()
    slices = doc["slices"]
    want = C.expected(x, mask)
    assert want["char_error"][32:].max() == 0.0 and want["char_error"][:32].mean() > 0
    assert slices["font=sans"]["metrics"]["char_error"]["mean"] == 0.0
    assert slices["font=serif"]["metrics"]["char_error"]["mean"] == pytest.approx(want["char_error"][:32].mean(),
                                                                                  abs=0.03)
