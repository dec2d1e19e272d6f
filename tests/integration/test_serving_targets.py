"""Serving targets (issue 23, item 3), without running a pipeline: the spec section and its checks, the node against
a target's `expect`, the compiled IR (one validate task per (variant, target) on that target's pool), and the
register step's per-target decisions. The kfp.local run with two local targets:
tests/integration/test_serving_targets_local.py.
"""

import json
from pathlib import Path

import pytest
import yaml

from tailguard.components.register.promotion import fastest_on_target, merge_gate_statuses
from tailguard.components.register.summary import VariantSummary
from tailguard.components.register.versions import validated_on, validated_on_text
from tailguard.components.validate.task import target_check
from tailguard.core.errors import SpecError
from tailguard.core.hardware import cpu_facts, expect_mismatches, fact_differences, gpu_capabilities, kernel_facts
from tailguard.core.spec import dump_spec, load_spec, parse_spec, spec_from_yaml
from tailguard.pipeline import compile_pipeline
from tailguard.runner import summary_rows, target_status, task_count
from tests.core.test_hardware import EPYC, SAPPHIRE
from tests.core.test_spec import TINY, locs, tiny
from tests.integration.test_pipeline import k8s_config, load_ir

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ROOT / "tests" / "data" / "targets_spec.yaml"
L4 = {"name": "l4", "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
      "tolerations": [{"key": "nvidia.com/gpu"}], "accelerator": {"type": "nvidia.com/gpu", "count": 1},
      "expect": {"compute_capability": ["8.9"]}}
VNNI = {"name": "vnni", "node_selector": {"node.kubernetes.io/instance-type": "c7i.2xlarge"},
        "expect": {"isa": ["avx512_vnni"]}}
AVX2 = {"name": "avx2", "node_selector": {"node.kubernetes.io/instance-type": "c5a.2xlarge"},
        "expect": {"isa": ["avx2"], "absent_isa": ["avx512_vnni", "avx_vnni"]}}


def facts_of(tmp_path, cpuinfo: str, gpus=None) -> dict:
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    return {"cpu": cpu_facts(path), "gpus": gpus}


def with_targets(*targets) -> dict:
    doc = tiny()
    doc["serving_targets"] = list(targets)
    return doc


# ------------------------------------------------------------------------------------------------------ spec
def test_spec_accepts_serving_targets_and_assigns_each_variant_the_targets_of_its_kind_when_cpu_and_gpu():
    spec = parse_spec(with_targets(VNNI, AVX2, L4))
    by_name = {v.name: [t.name for t in spec.targets_for(v)] for v in spec.variants}
    assert by_name == {"ort-fp32": ["vnni", "avx2"], "ort-int8": ["vnni", "avx2"], "trt-fp16": ["l4"]}
    assert spec_from_yaml(dump_spec(spec)) == spec  # the section round-trips through the tasks' spec text


def test_spec_refuses_a_variant_that_serves_on_no_target_when_only_cpu_targets_are_given():
    with pytest.raises(SpecError) as e:
        parse_spec(with_targets(VNNI))  # trt-fp16 is a GPU variant
    assert "variants.2" in locs(e.value)
    assert "accelerator" in str(e.value) and "trt-fp16" in str(e.value)


@pytest.mark.parametrize("targets, where, words", [
    ([VNNI, {**AVX2, "name": "vnni"}, L4], "serving_targets", "duplicate target names"),
    ([{**VNNI, "expect": {"isa": ["avx9000"]}}, L4], "serving_targets.0.expect.isa", "unknown ISA flag"),
    ([VNNI, {**L4, "expect": {"compute_capability": ["sm89"]}}], "serving_targets.1.expect.compute_capability",
     "major.minor"),
    ([{**VNNI, "name": "Not_A_Label"}, L4], "serving_targets.0.name", "pattern"),
])
def test_spec_refuses_bad_serving_targets_naming_the_field_when_written_wrong(targets, where, words):
    with pytest.raises(SpecError) as e:
        parse_spec(with_targets(*targets))
    assert where in locs(e.value) and words in str(e.value)


def test_spec_refuses_a_search_with_serving_targets_when_both_are_given():
    doc = with_targets(VNNI, L4)
    doc["variants"][1]["search"] = {"max_trials": 2}
    with pytest.raises(SpecError) as e:
        parse_spec(doc)
    assert "variants.1.search" in locs(e.value)


def test_spec_refuses_two_validate_tasks_with_one_name_when_variant_and_target_names_collide():
    doc = tiny()
    doc["variants"] = [{"name": "a-on-b", "backend": "onnxruntime", "precision": "fp32"},
                       {"name": "a", "backend": "onnxruntime", "precision": "fp32"}]
    doc["serving_targets"] = [{"name": "c"}, {"name": "b-on-c"}]
    with pytest.raises(SpecError) as e:
        parse_spec(doc)
    assert "validate-a-on-b-on-c" in str(e.value)


def test_dump_spec_leaves_serving_targets_out_when_none_are_given():
    # the text tasks receive (and the compiled IR, KFP's cache keys) stays what it was before the section existed
    assert "serving_targets" not in yaml.safe_load(dump_spec(load_spec(TINY)))
    assert "serving_targets" in yaml.safe_load(dump_spec(parse_spec(with_targets(VNNI, L4))))


# -------------------------------------------------------------------------------------------- node vs expect
def test_expect_mismatches_names_the_missing_and_forbidden_flags_when_the_node_differs(tmp_path):
    amd, intel = facts_of(tmp_path, EPYC), facts_of(tmp_path, SAPPHIRE)
    assert expect_mismatches(intel, isa=["avx512_vnni"]) == []
    [lacks] = expect_mismatches(amd, isa=["avx512_vnni"])
    assert "lacks avx512_vnni" in lacks and "avx2 fma f16c" in lacks
    assert expect_mismatches(amd, isa=["avx2"], absent_isa=["avx512_vnni", "avx_vnni"]) == []
    [has] = expect_mismatches(intel, isa=["avx2"], absent_isa=["avx512_vnni", "avx_vnni"])
    assert "has avx512_vnni avx_vnni" in has


def test_expect_mismatches_never_matches_unknown_flags_or_a_missing_gpu_when_expected(tmp_path):
    unknown = {"cpu": cpu_facts(tmp_path / "missing"), "gpus": None}
    assert "unknown" in expect_mismatches(unknown, absent_isa=["avx512_vnni"])[0]
    assert "no GPU" in expect_mismatches(unknown, compute_capability=["8.9"])[0]
    l4 = {"cpu": unknown["cpu"], "gpus": [{"index": 0, "name": "NVIDIA L4", "compute_capability": "8.9"}]}
    assert expect_mismatches(l4, compute_capability=["8.9", "9.0"]) == []
    assert "sm 8.9" in expect_mismatches(l4, compute_capability=["9.0"])[0]
    assert expect_mismatches(unknown) == []  # no expectation: nothing to differ from


def test_target_check_tags_the_run_with_target_placement_and_check_when_a_variant_is_validated_on_a_target(tmp_path):
    spec = parse_spec(with_targets(VNNI, AVX2, L4))
    amd = facts_of(tmp_path, EPYC)
    mismatch, tags = target_check(spec, "vnni", amd, "node_pool")
    assert mismatch and tags == {"tailguard.target": "vnni", "tailguard.target_placement": "node_pool",
                                 "tailguard.target_check": "mismatch"}
    assert target_check(spec, "avx2", amd, "")[1]["tailguard.target_check"] == "matched"
    assert target_check(spec, "avx2", amd, "")[1]["tailguard.target_placement"] == "this_node"
    no_expect = parse_spec(with_targets({"name": "any"}, L4))
    assert target_check(no_expect, "any", amd, "this_node") == ([], {
        "tailguard.target": "any", "tailguard.target_placement": "this_node", "tailguard.target_check": "no_expect"})


# ------------------------------------------------------------------------------------------------ compiled IR
def test_compiled_ir_has_one_validate_task_per_variant_and_target_on_that_targets_pool_when_targets_are_given(
        tmp_path):
    spec = parse_spec(with_targets(VNNI, AVX2, L4))
    out = tmp_path / "p.yaml"
    compile_pipeline(spec, str(out))
    ir = load_ir(out)
    dags = [ir["root"]["dag"]] + [c["dag"] for c in ir["components"].values() if "dag" in c]  # + the exit handler's
    every = {name: t for dag in dags for name, t in dag["tasks"].items()}
    tasks = {t["taskInfo"]["name"] for t in every.values()}
    validates = sorted(t for t in tasks if t.startswith("validate-"))
    assert validates == ["validate-ort-fp32-on-avx2", "validate-ort-fp32-on-vnni", "validate-ort-int8-on-avx2",
                         "validate-ort-int8-on-vnni", "validate-trt-fp16-on-l4"]
    assert len(tasks - {"finalize-run", "close-parent-run"}) == task_count(spec) == 6 + 3 + 5
    k8s = k8s_config(ir)
    selector = {t: k8s[f"exec-{t}"]["nodeSelector"]["labels"] for t in validates}
    assert selector["validate-ort-int8-on-vnni"] == VNNI["node_selector"]
    assert selector["validate-ort-int8-on-avx2"] == AVX2["node_selector"]
    assert selector["validate-trt-fp16-on-l4"] == L4["node_selector"]
    assert [t["key"] for t in k8s["exec-validate-trt-fp16-on-l4"]["tolerations"]] == ["nvidia.com/gpu"]
    accel = {t: ir["deploymentSpec"]["executors"][f"exec-{t}"]["container"].get("resources", {}).get("accelerator")
             for t in validates}
    assert accel["validate-trt-fp16-on-l4"]["resourceCount"] == "1"
    assert accel["validate-trt-fp16-on-l4"]["resourceType"] == "nvidia.com/gpu"
    assert accel["validate-ort-int8-on-vnni"] is None
    # the build stays on kubeflow.gpu's pool, the target's settings go to the validations only
    assert k8s["exec-build-trt-fp16"]["nodeSelector"]["labels"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert "nodeSelector" not in k8s.get("exec-build-ort-int8", {})
    placement = every["validate-ort-int8-on-vnni"]["inputs"]["parameters"]
    assert placement["placement"]["runtimeValue"]["constant"] == "node_pool"
    assert placement["target_name"]["runtimeValue"]["constant"] == "vnni"


def test_pure_tasks_step_specs_stay_the_same_when_serving_targets_are_added():
    # the build / export / reference-pass inputs (KFP cache keys) do not read the targets: adding them
    # invalidates no cached build
    from tailguard.pipeline import step_spec_yaml

    plain, targeted = parse_spec(tiny()), parse_spec(with_targets(VNNI, AVX2, L4))
    for variant in [None] + [v.name for v in plain.variants]:
        assert step_spec_yaml(plain, variant) == step_spec_yaml(targeted, variant)


# ------------------------------------------------------------------------------------------ register decisions
def row(name: str, **targets) -> VariantSummary:
    r = VariantSummary(name, "onnxruntime", "int8", "ok")
    r.targets = {t: {"status": "ok", "passed": p, "p50_ms": ms, "placement": "node_pool",
                     "hardware": {"cpu": "x", "isa": "avx2", "gpu": "none"}} for t, (p, ms) in targets.items()}
    r.passed = all(p for p, _ in targets.values())
    return r


def test_fastest_on_target_picks_the_lowest_p50_among_variants_passing_there_when_they_differ_by_target():
    a = row("a", vnni=(True, 2.0), avx2=(False, 1.0))
    b = row("b", vnni=(True, 3.0), avx2=(True, 4.0))
    c = row("c", vnni=(False, 0.5), avx2=(True, 5.0))
    assert fastest_on_target([a, b, c], "vnni") is a
    assert fastest_on_target([a, b, c], "avx2") is b
    assert fastest_on_target([a, c], "gpu") is None
    assert [r.variant for r in (a, b, c) if r.passed] == ["b"]  # the default alias: passing on every target


def test_merge_gate_statuses_keeps_each_gates_worst_status_when_targets_disagree():
    merged = merge_gate_statuses([{"g1": "passed", "g2": "passed", "g3": "not_applicable"},
                                  {"g1": "insufficient_data", "g2": "failed", "g3": "not_applicable"}])
    assert merged == {"g1": "insufficient_data", "g2": "failed", "g3": "not_applicable"}


def test_validated_on_lists_each_targets_node_when_registered_and_fits_the_tag_limit_when_long():
    r = row("a", vnni=(True, 2.0), avx2=(False, 1.0))
    entries = validated_on(r)
    assert [(e["target"], e["passed"], e["isa"]) for e in entries] == [("vnni", True, "avx2"), ("avx2", False, "avx2")]
    plain = validated_on(VariantSummary("a", "onnxruntime", "fp32", "ok", passed=True),
                         {"tailguard.hw.cpu": "AMD EPYC 7B13", "tailguard.hw.isa": "avx2 fma f16c",
                          "tailguard.hw.gpu": "NVIDIA L4 sm8.9; NVIDIA L4 sm8.9"})
    assert plain == [{"target": None, "status": "ok", "passed": True, "placement": "build_node",
                      "cpu": "AMD EPYC 7B13", "isa": "avx2 fma f16c", "gpu": "sm8.9 sm8.9"}]
    many = [dict(entries[0], target=f"t{i}", cpu="C" * 200) for i in range(40)]
    text = validated_on_text(many)
    assert len(text) <= 5000 and all("cpu" not in e for e in json.loads(text))


def test_summary_rows_name_each_targets_verdict_and_alias_when_a_variant_did_not_pass_everywhere():
    from tailguard.components.register.summary import RunSummary

    r = row("a", vnni=(True, 2.0), avx2=(False, 1.0))
    r.targets["avx2"]["status"] = "skipped"
    r.version, r.target_aliases = "3", ["production-vnni"]
    s = RunSummary("p", "0", "m", "1", "m-optimized", "production", True, 1, variants=[r])
    [cells] = summary_rows(s)
    assert cells["status"] == target_status(r) == "vnni: passed, avx2: skipped"
    assert cells["promoted"] == "@production-vnni -> v3"


# ------------------------------------------------------------------------------------------- node facts
def test_fact_differences_compares_isa_sets_and_gpu_capabilities_but_not_cpu_names_when_nodes_differ(tmp_path):
    amd, intel = kernel_facts(facts_of(tmp_path, EPYC)), kernel_facts(facts_of(tmp_path, SAPPHIRE))
    assert fact_differences(amd, dict(amd, cpu="another AVX2 CPU")) == {}
    diff = fact_differences(amd, intel)
    assert set(diff) == {"isa"} and diff["isa"]["node"] == "avx2 fma f16c"
    assert set(fact_differences(dict(amd, gpu="sm8.9"), dict(amd, gpu="sm9.0"))) == {"gpu"}
    assert fact_differences(dict(amd, gpu="sm8.9 sm8.9"), dict(amd, gpu="sm8.9")) == {}  # how many: no kernel change
    assert set(fact_differences(dict(amd, isa="unknown"), dict(amd, isa="unknown"))) == {"isa"}
    assert gpu_capabilities("NVIDIA L4 sm8.9; NVIDIA H100 80GB HBM3 sm9.0") == "sm8.9 sm9.0"
    assert gpu_capabilities("none") == "none"
