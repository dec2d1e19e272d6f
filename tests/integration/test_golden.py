"""Golden KFP IR for the example specs: `tailguard compile` output must not change unnoticed.

Regenerate after an intended change with `make golden` (then review the diff like code). The pure tasks' step
specs are compile-time constants holding the data files' absolute paths; the golden files write the repository's
root as REPO_TOKEN so that they compare equal in any checkout."""

from pathlib import Path

import pytest
import yaml

from tailguard.core.spec import load_spec
from tailguard.pipeline import compile_pipeline

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
REPO_TOKEN = "@REPO@"
EXAMPLES = {"minilm": ROOT / "examples" / "minilm" / "spec.yaml", "tiny": ROOT / "tests" / "data" / "tiny_spec.yaml",
            # serving_targets: one validate task per (variant, target) on the target's pool (issue 23)
            "targets": ROOT / "tests" / "data" / "targets_spec.yaml"}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_compiled_pipeline_matches_the_golden_ir_when_the_example_spec_compiles(name, tmp_path):
    out = tmp_path / f"{name}.yaml"
    compile_pipeline(load_spec(EXAMPLES[name]), str(out))
    golden = GOLDEN / f"{name}.pipeline.yaml"
    assert golden.exists(), "run `make golden`"
    # compared as YAML documents: the compiler folds long strings, and a root of another length folds elsewhere
    compiled = _with_token(list(yaml.safe_load_all(out.read_text())), str(ROOT))
    assert compiled == list(yaml.safe_load_all(golden.read_text())), \
        f"compiled IR differs from {golden}; run `make golden` if intended"


def _with_token(obj, root: str):
    """`obj` (parsed YAML) with every occurrence of the repository root in a string replaced by REPO_TOKEN."""
    if isinstance(obj, str):
        return obj.replace(root, REPO_TOKEN)
    if isinstance(obj, list):
        return [_with_token(v, root) for v in obj]
    if isinstance(obj, dict):
        return {_with_token(k, root): _with_token(v, root) for k, v in obj.items()}
    return obj
