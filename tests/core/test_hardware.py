"""Hardware facts (pipelines/core/hardware.py; issue 23 item 1, issue 26 item 9): the CPU model and the ISA flags
that change kernels, recorded in benchmark JSONs, build.json, the variant's MLflow tags and the run summary.

CPU descriptions of other machines are given as /proc/cpuinfo copies (the `cpuinfo` argument); the build, validate
and register tasks run for real (ONNX Runtime build, a real MLflow sqlite store). No GPU here: the GPU branch is
checked only for not importing torch when no GPU is visible.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailguard.core.contract import HW_CORES_TAG, HW_CPU_TAG, HW_GPU_TAG, HW_ISA_TAG
from tailguard.core.hardware import cpu_facts, gpu_unavailable_reason, hardware_tags, isa_text, node_facts, ran_on_line

ROOT = Path(__file__).resolve().parents[2]
EPYC = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n"
        "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 fma f16c avx avx2 bmi2 sha_ni\n\n"
        "processor\t: 1\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx512f\n")
SAPPHIRE = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n"
            "flags\t\t: avx2 fma f16c avx512f avx512_vnni avx_vnni amx_tile amx_int8 amx_bf16 avx512_bf16\n")


def _write(tmp_path, text):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return path


def test_cpu_facts_lists_only_the_kernel_isa_flags_of_the_first_cpu_when_cpuinfo_is_readable(tmp_path):
    amd = cpu_facts(_write(tmp_path, EPYC))
    assert (amd["vendor"], amd["model"]) == ("AuthenticAMD", "AMD EPYC 7B13")
    assert amd["isa"] == ["avx2", "fma", "f16c"]  # no VNNI: the int16-saturating INT8 kernel; processor 1 ignored
    assert amd["cores"] >= 1 and amd["isa_source"].endswith("cpuinfo")
    intel = cpu_facts(_write(tmp_path, SAPPHIRE))
    assert intel["isa"] == ["avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
                           "amx_int8", "amx_bf16"]


def test_cpu_facts_isa_unknown_not_guessed_when_cpuinfo_cannot_be_read(tmp_path):
    facts = {"cpu": cpu_facts(tmp_path / "missing")}
    assert facts["cpu"]["isa"] is None and facts["cpu"]["isa_source"] == "unknown" and facts["cpu"]["model"]
    assert isa_text(facts) == "unknown" and "(unknown)" in ran_on_line(facts)


def test_node_facts_names_cpu_isa_and_library_versions_without_importing_torch_when_no_gpu_is_visible():
    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is visible here: node_facts imports torch for its name and compute capability")
    code = ("import json, sys; from tailguard.core.hardware import node_facts; f = node_facts(); "
            "print(json.dumps({'facts': f, 'torch_imported': 'torch' in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["torch_imported"] is False and rec["facts"]["gpus"] is None
    assert set(rec["facts"]["libraries"]) == {"onnxruntime", "onnx", "torch", "numpy"}
    assert rec["facts"]["libraries"]["onnxruntime"] and rec["facts"]["cpu"]["model"]


def test_hardware_tags_and_ran_on_line_name_cpu_isa_cores_and_gpu(tmp_path):
    facts = {"cpu": cpu_facts(_write(tmp_path, SAPPHIRE)), "gpus": [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}]}
    tags = hardware_tags(facts)
    assert tags[HW_CPU_TAG] == "Intel(R) Xeon(R) Platinum 8481C" and "avx512_vnni" in tags[HW_ISA_TAG].split()
    assert tags[HW_GPU_TAG] == "NVIDIA H100 80GB HBM3 sm9.0" and int(tags[HW_CORES_TAG]) >= 1
    line = ran_on_line(facts)
    assert line.startswith("ran on: Intel(R) Xeon(R) Platinum 8481C (avx2 fma f16c avx512f avx512_vnni")
    assert "GPU: NVIDIA H100 80GB HBM3 (sm 9.0)" in line
    assert hardware_tags({"cpu": cpu_facts(_write(tmp_path, EPYC)), "gpus": None})[HW_GPU_TAG] == "none"


def test_benchmark_report_header_records_this_nodes_cpu_and_isa_flags():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from common import report_header
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    header = report_header("x", 2, ("onnxruntime",))
    assert header["hardware"]["cpu"] == node_facts()["cpu"] and "libraries" in header["hardware"]


def test_build_task_writes_the_build_nodes_hardware_facts_to_build_json(tmp_path, monkeypatch):
    from tailguard.components.build import task as build_task
    from tests.core.test_cache import spec_yaml, write_mlp

    monkeypatch.setenv("TAILGUARD_CACHE", "0")
    out = json.loads(build_task.main(spec_yaml=spec_yaml(), variant_name="ort-int8",
                                     onnx_dir=str(write_mlp(tmp_path / "fp32")), out_dir=str(tmp_path / "built")))
    on_disk = json.loads((tmp_path / "built" / "build.json").read_text())
    assert out["status"] == "ok"
    assert on_disk["hardware"]["cpu"] == out["hardware"]["cpu"] == node_facts()["cpu"]


def test_validate_task_tags_the_variant_run_with_the_nodes_cpu_and_isa(tmp_path, monkeypatch):
    import mlflow

    from tailguard.components.validate import task as validate_task
    from tailguard.core.results import BuildResult
    from tailguard.core.spec import dump_spec
    from tailguard.core.tracking import configure, experiment_name_for
    from tests.core.test_results import _spec

    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    before = os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_REGISTRY_URI")
    try:
        spec = _spec()
        exp = configure(uri, experiment_name_for(spec))
        client = mlflow.MlflowClient()
        parent = client.create_run(exp).info.run_id
        out = json.loads(validate_task.main(
            spec_yaml=dump_spec(spec), variant_name="ort-fp16", baselines_json="{}", parent_run_id=parent,
            tracking_uri=uri, variant_dir=str(tmp_path / "built"), reference_dir=str(tmp_path / "ref"),
            build_json=json.dumps(BuildResult("skipped", reason="no CUDA execution provider here").to_dict())))
        tags = client.get_run(out["run_id"]).data.tags
    finally:
        mlflow.set_tracking_uri(before[0])
        mlflow.set_registry_uri(before[1])
    assert {k: tags[k] for k in (HW_CPU_TAG, HW_ISA_TAG, HW_CORES_TAG, HW_GPU_TAG)} == hardware_tags(node_facts())


def test_run_summary_carries_baseline_hardware_and_warnings_and_prints_ran_on_line(monkeypatch):
    from rich.console import Console

    from tailguard import terminal
    from tailguard.components.register.finish import baseline_notes
    from tailguard.components.register.summary import RunSummary

    facts = {"cpu": {"model": "AMD EPYC 7B13", "isa": ["avx2", "fma", "f16c"], "cores": 2}, "gpus": None}
    hardware, warnings = baseline_notes(json.dumps({"rows": 3, "hardware": facts,
                                                    "warnings": ["torch baseline at batch 1 unstable: 1.8x"]}))
    summary = RunSummary(parent_run_id="p", experiment_id="1", source_model="m", source_version="1",
                         optimized_model="m-optimized", alias="production", promotion_enabled=True, batch_size=1,
                         hardware=hardware, warnings=warnings)
    again = RunSummary.from_dict(json.loads(json.dumps(summary.to_dict())))
    assert again.hardware == facts and again.warnings == ["torch baseline at batch 1 unstable: 1.8x"]
    assert baseline_notes("")[0]["cpu"] == node_facts()["cpu"]  # no baselines: this node's facts
    buf = io.StringIO()
    monkeypatch.setattr(terminal, "console", Console(file=buf, width=200, highlight=False))
    terminal.print_summary(again)
    text = buf.getvalue()
    assert "ran on: AMD EPYC 7B13 (avx2 fma f16c), 2 cores" in text
    assert "torch baseline at batch 1 unstable: 1.8x" in text


# ------------------------------------------------------------------------------------------ CPU pressure (PSI)
def _psi(path, total_us):
    path.write_text(f"some avg10=1.00 avg60=2.00 avg300=3.00 total={total_us}\n"
                    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    return path


def test_cpu_pressure_file_prefers_the_cgroup_v2_file_of_this_process_when_it_exists(tmp_path):
    from tailguard.core.hardware import cpu_pressure_file

    node = _psi(tmp_path / "node.pressure", 5)
    (tmp_path / "cgroup").write_text("4:memory:/x\n0::/kubepods/pod1/c1\n")
    assert cpu_pressure_file(tmp_path / "cgroup", roots=(tmp_path / "fs",), node=node) == node
    own = tmp_path / "fs" / "kubepods" / "pod1" / "c1"
    own.mkdir(parents=True)
    _psi(own / "cpu.pressure", 7)
    assert cpu_pressure_file(tmp_path / "cgroup", roots=(tmp_path / "fs",), node=node) == own / "cpu.pressure"
    assert cpu_pressure_file(tmp_path / "missing", roots=(), node=tmp_path / "no-psi") is None


def test_cpu_pressure_share_is_the_stall_growth_over_the_window_when_psi_is_readable(tmp_path):
    from tailguard.core.hardware import CpuPressure, cpu_stall_us

    path = _psi(tmp_path / "cpu.pressure", 1_000)
    assert cpu_stall_us(path) == 1_000
    with CpuPressure(path) as idle:
        pass  # the counter does not move: no stall
    assert idle.share == 0.0
    with CpuPressure(path) as busy:
        _psi(path, 1_000 + 10**12)  # stalled far longer than the window lasted: clipped to the whole window
    assert busy.share == 1.0 and busy.to_dict() == {"some_share": 1.0, "source": str(path)}
    (tmp_path / "garbled").write_text("some avg10=x\n")
    with CpuPressure(tmp_path / "garbled") as unread:
        pass
    assert unread.share is None and cpu_stall_us(tmp_path / "nope") is None


def test_cpu_pressure_reads_this_node_when_it_has_psi():
    from tailguard.core.hardware import CpuPressure, cpu_pressure_file

    if cpu_pressure_file() is None:
        pytest.skip("no PSI on this node (/proc/pressure/cpu missing)")
    with CpuPressure() as p:
        sum(i * i for i in range(10_000))
    assert p.share is not None and 0.0 <= p.share <= 1.0
