"""Golden KFP IR for the example specs: `tailguard compile` output must not change unnoticed.

Regenerate after an intended change with `make golden` (then review the diff like code)."""

from pathlib import Path

import pytest

from tailguard.builder import compile_pipeline
from tailguard.core.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
EXAMPLES = {"minilm": ROOT / "examples" / "minilm" / "spec.yaml", "tiny": ROOT / "tests" / "data" / "tiny_spec.yaml"}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_compiled_pipeline_matches_the_golden_ir_when_the_example_spec_compiles(name, tmp_path):
    out = tmp_path / f"{name}.yaml"
    compile_pipeline(load_spec(EXAMPLES[name]), str(out))
    golden = GOLDEN / f"{name}.pipeline.yaml"
    assert golden.exists(), "run `make golden`"
    assert out.read_text() == golden.read_text(), f"compiled IR differs from {golden}; run `make golden` if intended"
