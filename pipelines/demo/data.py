"""The demo's real data: WordNet 3.0 glosses, tokenized for all-MiniLM-L6-v2, labelled with 45 lexicographer classes.

WordNet 3.0 (Princeton; Debian package `wordnet-base`) files every synset under one of 45 lexicographer files
("noun.animal", "verb.weather", "adj.ppl", ...; see lexnames(5WN)). The class sizes are long-tailed (14,435 synsets
in "adj.all", 11,587 in "noun.artifact", down to 51 in "noun.Tops" and 42 in "noun.motive"), which makes the
lexname a natural slice for showing that a quantized embedder can hold up overall and still fail a rare class.

One row per synset: its definition (the gloss before the first quoted example), tokenized with the MiniLM
tokenizer, plus metadata columns used as slices. Three disjoint seeded samples are written as Parquet:

- validation.parquet: a *stratified* sample (at most `max_per_class` rows per lexname, then at most
  `n_validation` rows, rare classes keeping all their rows). Overall metrics computed on it are over this
  class-balanced sample, not over WordNet's natural class distribution.
- calibration.parquet: a uniform sample of the remaining rows (static INT8 calibration).
- traffic.parquet: another uniform sample of the rest (natural class mix) for the shadow-monitor replay.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tailguard.core.errors import InputError

# lexnames(5WN), WordNet 3.0: lexicographer file number -> name. Debian's wordnet-base does not ship the
# `lexnames` file itself, so the table is kept here; a `lexnames` file in the WordNet folder takes precedence.
LEXNAMES: tuple[str, ...] = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact", "noun.attribute",
    "noun.body", "noun.cognition", "noun.communication", "noun.event", "noun.feeling", "noun.food", "noun.group",
    "noun.location", "noun.motive", "noun.object", "noun.person", "noun.phenomenon", "noun.plant",
    "noun.possession", "noun.process", "noun.quantity", "noun.relation", "noun.shape", "noun.state",
    "noun.substance", "noun.time", "verb.body", "verb.change", "verb.cognition", "verb.communication",
    "verb.competition", "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather", "adj.ppl",
)
DATA_FILES: dict[str, str] = {"noun": "data.noun", "verb": "data.verb", "adj": "data.adj", "adv": "data.adv"}
# wndb(5WN) ss_type: n NOUN, v VERB, a ADJECTIVE, s ADJECTIVE SATELLITE, r ADVERB.
SS_TYPE_POS: dict[str, str] = {"n": "noun", "v": "verb", "a": "adj", "s": "adj", "r": "adv"}
DEFAULT_WORDNET_DIRS: tuple[str, ...] = ("/usr/share/wordnet", "/usr/local/WordNet-3.0/dict",
                                         "/usr/share/WordNet-3.0/dict")
INSTALL_HINT = ("apt-get install wordnet-base (Debian/Ubuntu; `make demo` installs it), or point WNHOME / "
                "the wordnet_dir argument at a WordNet 3.0 dict folder holding data.noun, data.verb, data.adj, "
                "data.adv")
# rare_token_rate: a word-piece is "rare" when it belongs to the rarest types that together make up at most this
# fraction of all word-piece occurrences in the gloss corpus (see `rare_token_mask`).
RARE_MASS = 0.05
COLUMNS: tuple[str, ...] = ("input_ids", "attention_mask", "lexname", "pos", "n_tokens", "rare_token_rate",
                            "synset_offset", "synset_id", "text")


@dataclass(frozen=True)
class Gloss:
    """One WordNet synset's definition.

    Attributes:
        synset_id: "<8-digit offset>-<n|v|a|r>" (the Open Multilingual WordNet id; unique across files).
        synset_offset: byte offset of the synset in its data file (unique within one part of speech only).
        pos: "noun", "verb", "adj" (adjectives and satellites) or "adv".
        lexname: lexicographer class, e.g. "noun.animal".
        text: the definition: the gloss up to its first quoted example sentence.
    """

    synset_id: str
    synset_offset: int
    pos: str
    lexname: str
    text: str


# ------------------------------------------------------------------------------------------- reading
def find_wordnet_dir(wordnet_dir: str | Path | None = None) -> Path:
    """The WordNet 3.0 database folder (the one holding data.noun, data.verb, data.adj, data.adv).

    Looked up in order: `wordnet_dir` (only it, when given), $WNSEARCHDIR, $WNHOME/dict, $WNHOME,
    then DEFAULT_WORDNET_DIRS (/usr/share/wordnet is Debian's wordnet-base).

    Raises:
        InputError: no such folder; the hint says `apt-get install wordnet-base`.
    """
    if wordnet_dir is not None:
        folders = [Path(wordnet_dir)]
    else:
        folders = []
        if os.environ.get("WNSEARCHDIR"):
            folders.append(Path(os.environ["WNSEARCHDIR"]))
        if os.environ.get("WNHOME"):
            folders += [Path(os.environ["WNHOME"]) / "dict", Path(os.environ["WNHOME"])]
        folders += [Path(p) for p in DEFAULT_WORDNET_DIRS]
    for folder in folders:
        if all((folder / name).is_file() for name in DATA_FILES.values()):
            return folder
    looked = ", ".join(str(c) for c in folders)
    raise InputError(f"WordNet 3.0 database not found (looked in: {looked}); "
                     f"need files {', '.join(DATA_FILES.values())}", hint=INSTALL_HINT)


def read_lexnames(folder: Path) -> tuple[str, ...]:
    """Lexicographer file names by number: the folder's `lexnames` file if present, else LEXNAMES.

    Raises:
        InputError: a `lexnames` line is not "<number>\\t<name>\\t<category>".
    """
    path = folder / "lexnames"
    if not path.is_file():
        return LEXNAMES
    names: dict[int, str] = {}
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) < 2 or not parts[0].isdigit():
            raise InputError(f"{path}:{i}: expected '<number> <name> <category>', got {line!r}",
                             hint="restore the file from the WordNet 3.0 distribution, or delete it to use "
                                  "the built-in lexnames(5WN) table")
        names[int(parts[0])] = parts[1]
    return tuple(names.get(i, f"lex.{i:02d}") for i in range(max(names) + 1)) if names else LEXNAMES


def _definition(gloss: str) -> str:
    """The gloss up to its first quoted example ('...; "example"'), stripped."""
    cut = gloss.find('; "')
    text = (gloss if cut < 0 else gloss[:cut]).strip()
    if text.startswith('"'):  # a gloss made only of examples: keep it whole, without the outer quotes
        text = gloss.strip().strip('"').strip()
    return text


def read_wordnet_glosses(wordnet_dir: str | Path | None = None) -> list[Gloss]:
    """Every synset of WordNet 3.0 (data.noun, data.verb, data.adj, data.adv), in file order.

    Line format (wndb(5WN)): `synset_offset lex_filenum ss_type w_cnt word lex_id ... | gloss`; license lines
    at the top of each file start with two spaces.

    Args:
        wordnet_dir: the database folder (default: `find_wordnet_dir()`).

    Returns:
        One Gloss per synset (117,659 for WordNet 3.0), ordered noun, verb, adj, adv, then by offset.

    Raises:
        InputError: no WordNet folder, or a malformed line (naming the file and line number).
    """
    folder = find_wordnet_dir(wordnet_dir)
    lexnames = read_lexnames(folder)
    out: list[Gloss] = []
    for pos, name in DATA_FILES.items():
        path = folder / name
        with path.open(encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.startswith("  ") or not line.strip():
                    continue
                head, sep, gloss = line.partition(" | ")
                fields = head.split()
                try:
                    if not sep or len(fields) < 4:
                        raise ValueError("no ' | ' gloss separator or fewer than 4 fields")
                    offset, lex_filenum, ss_type = int(fields[0]), int(fields[1]), fields[2]
                    lexname = lexnames[lex_filenum]
                    if SS_TYPE_POS.get(ss_type) != pos:
                        raise ValueError(f"ss_type {ss_type!r} does not belong in {name}")
                except (ValueError, IndexError) as exc:
                    raise InputError(f"{path}:{lineno}: not a WordNet data line ({exc}): {line[:80]!r}",
                                     hint="use an unmodified WordNet 3.0 database (" + INSTALL_HINT + ")") from None
                text = _definition(gloss)
                if text:
                    out.append(Gloss(f"{offset:08d}-{ss_type if ss_type != 's' else 'a'}", offset, pos, lexname,
                                     text))
    if not out:
        raise InputError(f"{folder}: the WordNet data files hold no synsets", hint=INSTALL_HINT)
    return out


# ----------------------------------------------------------------------------------------- features
def rare_token_mask(token_ids: Sequence[np.ndarray], vocab_size: int, *, mass: float = RARE_MASS) -> np.ndarray:
    """Which word-piece ids are "rare" in a corpus: the rarest types holding at most `mass` of all occurrences.

    Types are sorted by corpus count, rarest first; a type is rare when its count is <= c*, the largest count
    such that all types with count <= c* together account for at most `mass` of the corpus' token occurrences
    (ties are all in or all out, so the result does not depend on sort order). This is the "rare tail of the
    token-frequency distribution" used e.g. for Zipfian slices of a vocabulary.

    Args:
        token_ids: one int array of word-piece ids per text (special tokens already removed).
        vocab_size: size of the id space.
        mass: fraction of occurrences, in (0, 1).

    Returns:
        (vocab_size,) bool, True for rare ids (ids never seen are False).
    """
    counts = np.bincount(np.concatenate(list(token_ids)) if len(token_ids) else np.zeros(0, np.int64),
                         minlength=vocab_size)
    seen = np.unique(counts[counts > 0])
    if seen.size == 0:
        return np.zeros(vocab_size, dtype=bool)
    # occurrences held by all types with count <= c, for each distinct count c
    ordered = np.sort(counts[counts > 0])
    mass_upto = np.cumsum(ordered)[np.searchsorted(ordered, seen, side="right") - 1]
    ok = seen[mass_upto <= mass * counts.sum()]
    if ok.size == 0:
        return np.zeros(vocab_size, dtype=bool)
    return (counts > 0) & (counts <= ok.max())


def tokenize_glosses(texts: Sequence[str], *, max_length: int = 128, tokenizer=None) -> list[np.ndarray]:
    """Word-piece ids per text, with [CLS] and [SEP], truncated to `max_length` tokens.

    Args:
        texts: the texts.
        max_length: most tokens per text, special tokens included.
        tokenizer: a `tokenizers.Tokenizer` (default: `tailguard.models.minilm_tokenizer`).

    Returns:
        One (n_tokens,) int64 array per text.
    """
    if tokenizer is None:
        from tailguard.models import minilm_tokenizer

        tokenizer = minilm_tokenizer(max_length)
    else:
        tokenizer.enable_truncation(max_length=max_length)
    return [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(list(texts))]


# ------------------------------------------------------------------------------------------ sampling
def capped_quotas(sizes: dict[str, int], *, max_per_class: int, total: int) -> dict[str, int]:
    """Rows to draw per class: at most `max_per_class` each, at most `total` in all, small classes kept whole.

    Water-filling: classes are visited from smallest to largest and each gets an equal share of what is
    left, capped by its own size (and `max_per_class`); the slack of small classes goes to the larger ones.

    Args:
        sizes: {class: available rows}.
        max_per_class: cap per class.
        total: cap on the sum.

    Returns:
        {class: rows to draw}, summing to min(total, sum of min(size, max_per_class)).
    """
    caps = {k: min(n, max_per_class) for k, n in sizes.items()}
    quota: dict[str, int] = {}
    remaining = total
    order = sorted(caps, key=lambda k: (caps[k], k))
    for i, k in enumerate(order):
        share = remaining // (len(order) - i)
        quota[k] = min(caps[k], share)
        remaining -= quota[k]
    return quota


def split_indices(lexnames: Sequence[str], *, n_validation: int, n_calibration: int, n_traffic: int,
                  max_per_class: int, seed: int) -> dict[str, np.ndarray]:
    """Disjoint seeded row indices for the three datasets (see the module docstring for the design).

    Returns:
        {"validation" | "calibration" | "traffic": int64 row indices}: validation and calibration sorted,
        traffic in (seeded) random arrival order.

    Raises:
        InputError: fewer rows than asked for after the validation sample.
    """
    rng = np.random.default_rng(seed)
    labels = np.asarray(lexnames, dtype=object)
    groups = {k: np.flatnonzero(labels == k) for k in sorted(set(lexnames))}
    quota = capped_quotas({k: len(v) for k, v in groups.items()}, max_per_class=max_per_class, total=n_validation)
    val = np.sort(np.concatenate([rng.choice(groups[k], size=quota[k], replace=False) for k in groups]
                                 + [np.zeros(0, np.int64)]).astype(np.int64))
    rest = np.setdiff1d(np.arange(len(labels), dtype=np.int64), val)
    need = n_calibration + n_traffic
    if need > len(rest):
        raise InputError(f"only {len(rest)} rows are left after the validation sample of {len(val)}, but "
                         f"n_calibration + n_traffic = {need}",
                         hint="lower n_calibration / n_traffic / n_validation")
    picked = rng.choice(rest, size=need, replace=False)
    # Traffic keeps the sample's random order: it is replayed as arrival order, where classes interleave.
    return {"validation": val, "calibration": np.sort(picked[:n_calibration]),
            "traffic": picked[n_calibration:].astype(np.int64)}


# ------------------------------------------------------------------------------------------- writing
def _table(glosses: Sequence[Gloss], ids: Sequence[np.ndarray], rare: np.ndarray, rows: Iterable[int],
           metadata: dict[str, str]) -> pa.Table:
    rows = list(rows)
    id_lists = [ids[i].tolist() for i in rows]
    body = [ids[i][1:-1] if len(ids[i]) > 2 else ids[i][:0] for i in rows]  # without [CLS]/[SEP]
    arrays = [
        pa.array(id_lists, type=pa.list_(pa.int64())),
        pa.array([[1] * len(x) for x in id_lists], type=pa.list_(pa.int64())),
        pa.array([glosses[i].lexname for i in rows], type=pa.string()),
        pa.array([glosses[i].pos for i in rows], type=pa.string()),
        pa.array([len(x) for x in id_lists], type=pa.int64()),
        pa.array([float(rare[b].mean()) if len(b) else 0.0 for b in body], type=pa.float64()),
        pa.array([glosses[i].synset_offset for i in rows], type=pa.int64()),
        pa.array([glosses[i].synset_id for i in rows], type=pa.string()),
        pa.array([glosses[i].text for i in rows], type=pa.string()),
    ]
    schema = pa.schema([pa.field(n, a.type) for n, a in zip(COLUMNS, arrays)],
                       metadata={b"tailguard.demo_data": json.dumps(metadata, sort_keys=True).encode()})
    return pa.Table.from_arrays(arrays, schema=schema)


def build_wordnet_datasets(out_dir: Path, *, n_validation: int = 2500, n_calibration: int = 512,
                           n_traffic: int = 3000, max_per_class: int = 80, seed: int = 0, max_length: int = 128,
                           wordnet_dir: str | Path | None = None) -> dict[str, Path]:
    """Write the demo's validation, calibration and traffic Parquet files from WordNet 3.0.

    Columns (one row per synset definition):
        input_ids: list<int64>, (n_tokens,) MiniLM word-piece ids with [CLS] ... [SEP], truncated to max_length.
        attention_mask: list<int64>, (n_tokens,) all ones (padding happens per batch, see tailguard.core.data).
        lexname: string, the lexicographer class (45 values, LEXNAMES).
        pos: string, noun | verb | adj | adv.
        n_tokens: int64, len(input_ids), special tokens included (2..max_length).
        rare_token_rate: float64 in [0, 1], the fraction of the definition's word-pieces ([CLS]/[SEP] excluded)
            that are rare over the *whole* WordNet gloss corpus: the rarest types that together hold at most 5%
            of all word-piece occurrences (`rare_token_mask`, RARE_MASS).
        synset_offset: int64, the synset's byte offset in its data file.
        synset_id: string, "<offset>-<n|v|a|r>", unique.
        text: string, the definition.

    Sampling (seeded, disjoint): validation is stratified by lexname (`capped_quotas`: at most
    `max_per_class` per class, at most `n_validation` in all, rare classes keep every row, so overall metrics
    are over a class-balanced sample); calibration and traffic are uniform samples of the remaining rows.
    Same arguments and WordNet files -> byte-identical files.

    Args:
        out_dir: folder to write into (created).
        n_validation: most validation rows.
        n_calibration: calibration rows.
        n_traffic: traffic rows (monitor replay).
        max_per_class: most validation rows per lexname.
        seed: sampling seed.
        max_length: most tokens per row, special tokens included.
        wordnet_dir: WordNet dict folder (default: `find_wordnet_dir()`).

    Returns:
        {"validation" | "calibration" | "traffic": path of the Parquet file}.

    Raises:
        InputError: WordNet not found (hint: apt-get install wordnet-base), a malformed data file, or too few
            rows for the sizes asked for.
        MissingDependencyError: the MiniLM tokenizer package is not installed (the `demo` extra).
    """
    for name, value in (("n_validation", n_validation), ("n_calibration", n_calibration),
                        ("n_traffic", n_traffic), ("max_per_class", max_per_class)):
        if value < 0:
            raise InputError(f"{name} must be >= 0, got {value}")
    if max_length < 2:
        raise InputError(f"max_length must be >= 2 ([CLS] and [SEP]), got {max_length}")
    glosses = read_wordnet_glosses(wordnet_dir)
    from tailguard.models import minilm_tokenizer

    tokenizer = minilm_tokenizer(max_length)
    ids = tokenize_glosses([g.text for g in glosses], max_length=max_length, tokenizer=tokenizer)
    rare = rare_token_mask([x[1:-1] for x in ids], tokenizer.get_vocab_size())
    splits = split_indices([g.lexname for g in glosses], n_validation=n_validation, n_calibration=n_calibration,
                           n_traffic=n_traffic, max_per_class=max_per_class, seed=seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, rows in splits.items():
        meta = {"source": "WordNet 3.0 (data.noun/verb/adj/adv), definitions without examples",
                "tokenizer": "sentence-transformers/all-MiniLM-L6-v2", "split": split, "seed": str(seed),
                "max_length": str(max_length), "max_per_class": str(max_per_class),
                "rare_token_mass": str(RARE_MASS), "corpus_rows": str(len(glosses))}
        path = out_dir / f"{split}.parquet"
        pq.write_table(_table(glosses, ids, rare, rows, meta), path, compression="zstd")
        paths[split] = path
    return paths
