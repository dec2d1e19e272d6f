"""Per-task timings of a local run (issue 15) and what tasks import at start-up.

Real parts: `task_entry` around real functions, a real kfp.local run (SubprocessRunner) of a two-task pipeline
whose log is read by `tailguard.runner.task_timings`, real subprocesses for the import checks (a dynamic INT8
build task on the tiny encoder, the data check on real Parquet files). No mocks. No assertion depends on how long
anything took: only on which fields exist, their order and that seconds add up (wall >= body >= imports >= 0).
"""

# No `from __future__ import annotations`: kfp reads the component's annotations as types.
import builtins
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kfp import dsl

from tailguard.components.images import CPU_IMAGE
from tailguard.components.register.summary import RunSummary
from tailguard.core.taskio import TIMING_MARKER, task_entry
from tailguard.runner import task_timings, timings_line

REPO = Path(__file__).resolve().parents[2]


def _timing_lines(text: str) -> list[dict]:
    return [json.loads(line.split(TIMING_MARKER, 1)[1]) for line in text.splitlines() if TIMING_MARKER in line]


# ------------------------------------------------------------------------------------------- task_entry
def test_task_entry_prints_body_import_seconds_and_cached_when_the_task_returns(capsys, tmp_path, monkeypatch):
    (tmp_path / "tg_fresh_module_for_timing.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = builtins.__import__

    @task_entry("build-variant")
    def main(*, variant_name: str) -> str:
        import tg_fresh_module_for_timing  # noqa: F401  (a first import: the clock must see it)

        return json.dumps({"status": "ok", "cached": True})

    assert json.loads(main(variant_name="ort-int8"))["cached"] is True
    (rec,) = _timing_lines(capsys.readouterr().out)
    assert rec["step"] == "build-variant" and rec["ok"] is True and rec["cached"] is True
    assert rec["variant"] == "ort-int8"
    assert rec["body_s"] >= rec["imports_s"] > 0.0
    assert builtins.__import__ is before  # the import clock is removed after the body


def test_task_entry_freezes_the_gc_heap_for_a_fast_exit_when_the_body_returned_and_not_when_it_raised():
    import gc

    from tailguard.core.errors import InputError

    @task_entry("export")
    def ok() -> str:
        return "{}"

    @task_entry("export")
    def bad() -> str:
        raise InputError("bad file")

    gc.unfreeze()
    try:
        with pytest.raises(InputError):
            bad()
        assert gc.get_freeze_count() == 0  # a failed body exits the normal way
        ok()
        assert gc.get_freeze_count() > 0  # the interpreter's final collection skips what the task made
    finally:
        gc.unfreeze()


def test_task_entry_prints_a_timing_line_with_ok_false_when_the_task_raises(capsys):
    from tailguard.core.errors import InputError

    @task_entry("check-data")
    def main() -> str:
        raise InputError("bad file")

    with pytest.raises(InputError):
        main()
    (rec,) = _timing_lines(capsys.readouterr().out)
    assert rec["step"] == "check-data" and rec["ok"] is False and rec["cached"] is None


# --------------------------------------------------------------------------------------- the run's log
@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def timed_task(step: str, cached: bool) -> str:
    import json

    from tailguard.core.taskio import task_entry

    @task_entry(step)
    def main() -> str:
        import colorsys  # noqa: F401

        return json.dumps({"cached": cached})

    return main()


@dsl.pipeline(name="timings-test")
def two_tasks() -> None:
    from tailguard.pipeline import named

    # one component, two tasks: named (as tailguard.pipeline does) keeps KFP from calling the second timed-task-2
    first = named(timed_task, "export")(step="export", cached=True)
    named(timed_task, "build-int8")(step="build", cached=False).after(first)


def test_task_timings_reads_wall_body_cached_and_task_names_when_kfp_local_ran_the_pipeline(tmp_path):
    from kfp import local

    from tailguard.runner import _redirect

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"),
               raise_on_error=True)
    log = tmp_path / "pipeline.log"
    with _redirect(log, None):
        two_tasks()
    t = task_timings(log.read_text())
    assert [(r["task"], r["status"], r["cached"]) for r in t["tasks"]] == [
        ("export", "success", True), ("build-int8", "success", False)]
    for r in t["tasks"]:
        assert r["wall_s"] >= r["body_s"] >= r["imports_s"] >= 0.0
        assert r["overhead_s"] == pytest.approx(r["wall_s"] - r["body_s"], abs=2e-3)
    assert t["total_s"] >= sum(r["wall_s"] for r in t["tasks"]) - 0.01
    assert 0.0 < t["startup_share"] <= 1.0
    assert t["startup_s"] == pytest.approx(sum(r["overhead_s"] + r["imports_s"] for r in t["tasks"]), abs=2e-3)


LOG = """\
23:59:58.000 - INFO - Running pipeline: 'p'
23:59:58.100 - INFO - Executing task \x1b[96m'check-data'\x1b[0m
    TAILGUARD_TASK_TIMING {"step": "check-data", "body_s": 1.0, "imports_s": 0.5, "ok": true, "hosted": true, "cached": null}
00:00:00.100 - INFO - Task \x1b[96m'check-data'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m
00:00:00.200 - INFO - Executing task 'export'
    Traceback: the task died before its body ran
00:00:01.200 - INFO - Task 'export' finished with status FAILURE
00:00:01.300 - INFO - Pipeline 'p' finished with status FAILURE
"""


def test_task_timings_crosses_midnight_and_leaves_body_unknown_when_a_task_printed_no_timing_line():
    t = task_timings(LOG)
    check, export = t["tasks"]
    assert check == {"task": "check-data", "variant": None, "status": "success", "cached": None, "hosted": True,
                     "wall_s": 2.0, "body_s": 1.0, "imports_s": 0.5, "overhead_s": 1.0}
    assert export["status"] == "failure" and export["wall_s"] == 1.0 and export["body_s"] is None
    assert export["hosted"] is None
    assert t["total_s"] == 3.2 and t["startup_s"] == 1.5 and t["startup_share"] == 0.75


def test_timings_line_shows_cached_and_ran_per_task_when_timings_are_known():
    line = timings_line({"tasks": [{"task": "export", "status": "success", "cached": True, "wall_s": 0.41},
                                   {"task": "build-int8", "variant": "int8", "status": "success",
                                    "cached": False, "wall_s": 1.26},
                                   {"task": "validate-fp32", "variant": "fp32", "status": "success",
                                    "cached": None, "wall_s": 8.0},
                                   {"task": "register-and-promote", "status": "failure", "wall_s": None}],
                         "total_s": 9.9, "startup_s": 6.0, "startup_share": 0.6})
    assert line == ("tasks 9.9 s, start-up + imports 60%: export 0.4 s cached, build-int8 1.3 s ran, "
                    "validate-fp32 8.0 s, register-and-promote ? failure")
    assert timings_line(None) == "" and timings_line({"tasks": []}) == ""


def test_run_summary_keeps_tasks_when_round_tripped_and_reads_old_summaries_without_them():
    base = {"parent_run_id": "r", "experiment_id": "1", "source_model": "m", "source_version": "1",
            "optimized_model": "m-optimized", "alias": "production", "promotion_enabled": True, "batch_size": 1}
    old = RunSummary.from_dict(base)
    assert old.tasks is None
    tasks = task_timings(LOG)
    new = RunSummary.from_dict({**base, "tasks": tasks})
    assert RunSummary.from_dict(json.loads(json.dumps(new.to_dict()))).tasks == tasks


# ------------------------------------------------------------------------------- start-up: what is imported
def _env() -> dict[str, str]:
    return {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "GX_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
            "TAILGUARD_CACHE": "0"}


def test_build_task_imports_no_pandas_mlflow_or_torch_when_the_variant_is_int8_dynamic(tmp_path):
    from tests.helpers.tiny_models import export_tiny

    _, model_spec, path = export_tiny(tmp_path)
    onnx_dir = tmp_path / "onnx"
    onnx_dir.mkdir()
    Path(path).rename(onnx_dir / "model.onnx")
    spec = {"apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "imports"},
            "model": model_spec.model_dump(mode="json"),
            "data": {"calibration": {"uri": str(tmp_path / "c.parquet")},
                     "validation": {"uri": str(tmp_path / "v.parquet")}},
            "variants": [{"name": "ort-int8-dynamic", "backend": "onnxruntime", "precision": "int8",
                          "quantization": {"mode": "dynamic"}}],
            "gates": [{"metric": "top1_agreement", "min": 0.9}]}
    code = textwrap.dedent(f"""
        import json, sys
        from tailguard.components.build.task import main
        out = json.loads(main(spec_yaml=json.dumps({spec!r}), variant_name="ort-int8-dynamic",
                              onnx_dir={str(onnx_dir)!r}, out_dir={str(tmp_path / 'out')!r}))
        print(json.dumps({{"status": out["status"], "loaded": [m for m in ("pandas", "mlflow", "torch",
                                                                          "great_expectations")
                                                                if m in sys.modules]}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"status": "ok", "loaded": []}


def test_check_data_imports_no_great_expectations_when_the_spec_declares_no_expectations(tmp_path):
    import pandas as pd

    rows = pd.DataFrame({"features": [[0.1 * i, 0.2, 0.3] for i in range(12)], "label": [i % 3 for i in range(12)]})
    rows.to_parquet(tmp_path / "v.parquet")
    doc = {"apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "gx-free"},
           "model": {"registered_name": "m", "task": "classification",
                     "inputs": [{"name": "features", "dtype": "float32", "shape": ["batch", 3]}],
                     "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 3]}]},
           "data": {"calibration": {"uri": str(tmp_path / "v.parquet")},
                    "validation": {"uri": str(tmp_path / "v.parquet"), "label_column": "label"}},
           "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
           "gates": [{"metric": "top1_agreement", "min": 0.9}]}
    code = textwrap.dedent(f"""
        import json, sys
        from tailguard.components.check_data.task import main
        report = json.loads(main(spec_yaml=json.dumps({doc!r}), report_dir={str(tmp_path / 'report')!r}))
        print(json.dumps({{"success": report["success"], "evaluated": report["counts"]["evaluated"],
                          "gx": "great_expectations" in sys.modules}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"success": True, "evaluated": 12, "gx": False}


def test_builtin_checks_report_what_great_expectations_reports_when_run_without_it(tmp_path):
    import numpy as np
    import pandas as pd

    from tailguard.components.check_data.logic import check_datasets
    from tailguard.core.spec import parse_spec

    rng = np.random.default_rng(0)
    bad = pd.DataFrame({"ids": [rng.integers(1, 60, size=int(n)).astype(np.int64) for n in rng.integers(3, 9, 30)],
                        "x": [rng.normal(size=4).astype(np.float32) for _ in range(30)],
                        "label": rng.integers(0, 3, 30).astype(np.float64)})
    bad.at[2, "ids"] = np.array([1, 2, 900], dtype=np.int64)  # outside value_range
    bad.at[7, "x"] = np.array([0.1, np.nan, 0.3, np.inf], dtype=np.float32)  # not finite
    bad.at[9, "x"] = np.array([0.1, 0.3], dtype=np.float32)  # wrong shape
    bad.at[11, "x"] = None  # null row
    bad.loc[5, "label"] = None  # null label
    bad.to_parquet(tmp_path / "bad.parquet")

    def spec(expectations):
        return parse_spec({
            "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "same"},
            "model": {"registered_name": "m", "task": "classification",
                      "inputs": [{"name": "ids", "dtype": "int64", "shape": ["batch", "sequence"],
                                  "value_range": [0, 63]},
                                 {"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
                      "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 3]}]},
            "data": {"calibration": {"uri": str(tmp_path / "bad.parquet"), "stratify_by": "nope"},
                     "validation": {"uri": str(tmp_path / "bad.parquet"), "label_column": "label", "min_rows": 50},
                     "expectations": expectations},
            "slices": [{"name": "s", "column": "missing_column"}],
            "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
            "gates": [{"metric": "top1_agreement", "min": 0.9}]})

    native = check_datasets(spec([]), raise_on_failure=False)
    with_gx = check_datasets(spec([{"type": "expect_column_to_exist", "kwargs": {"column": "label"}}]),
                             raise_on_failure=False)
    assert native.gx_version == "" and with_gx.gx_version
    assert sum(not r.success for d in native.datasets for r in d.results) >= 8
    for ours, theirs in zip(native.datasets, with_gx.datasets):
        assert ours.results == [r for r in theirs.results if r.origin == "builtin"]
