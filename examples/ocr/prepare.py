"""Fetch the PP-OCRv4 text recognizer shipped in the PyPI wheel rapidocr-onnxruntime 1.4.4 and render text lines for it.

The recognizer (`rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx` in the wheel) reads one text line image,
(batch, 3, 48, W) float32 normalised to [-1, 1], and gives (batch, W / 8, 6625) CTC probabilities (softmax):
class 0 is the CTC blank, 1..6623 the characters of its dictionary (kept in the model's `character` metadata
property, one per line), 6624 the space. The wheel is fetched with `pip download --no-deps` and checked against
WHEEL_SHA256 before anything is read from it; rapidocr itself is never installed (its dependencies are heavy, and
tailguard runs the model with its own ONNX Runtime).

Lines are rendered with PIL and Debian's DejaVu fonts (/usr/share/fonts/truetype/dejavu, package fonts-dejavu-core),
resized to height 48 and padded to width 320 (as rapidocr does for lines up to 320/48 wide: longer ones are cut by
the renderer's text lengths below), with their metadata as slice columns:

    script      latin | upper | digits | mixed | greek   (what the text is; greek letters are outside the model's
                                                          dictionary, so FP32 itself reads them badly: a hard slice)
    font        DejaVu face file stem, e.g. DejaVuSerif-Italic
    size        font size in points before the resize to height 48 (16..40)
    noise       none | low | high  (additive Gaussian noise, sigma 0 / 8 / 20 grey levels)
    background  light | dark (dark: white text on a dark ground, ~1.5% of rows as in issue 38)
    text        the rendered string (not an input; for the report's worst rows)

Writes into --out (default data/ beside spec.yaml; git ignores it):

    ppocr_rec.onnx          the recognizer as shipped (opset 12)
    characters.txt          its dictionary, one character per line (index i+1 in the output)
    validation.parquet      --rows rows (default 600): column `x` ((3, 48, 320) float32, the model input), metadata
    calibration.parquet     64 other rows (static INT8 calibration)
    wheel.json              the wheel's file name, sha256 and the model file's sha256

    python examples/ocr/prepare.py                # or: make example-ocr (also registers, checks, runs, reports)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
WHEEL = "rapidocr-onnxruntime==1.4.4"
WHEEL_FILE = "rapidocr_onnxruntime-1.4.4-py3-none-any.whl"
WHEEL_SHA256 = "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf"  # PyPI, checked 2026-11-28
REC_MEMBER = "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx"
FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")
FONTS = ("DejaVuSans", "DejaVuSerif", "DejaVuSansMono", "DejaVuSansCondensed", "DejaVuSans-Bold",
         "DejaVuSerif-Italic")
HEIGHT, WIDTH = 48, 320
WORDS = ("quantize", "tensor", "latency", "gate", "slice", "model", "parity", "river", "window", "market",
         "orange", "signal", "winter", "garden", "letter", "number", "station", "bridge", "harbor", "silver",
         "invoice", "total", "street", "ticket", "coffee", "paper", "engine", "planet", "forest", "music")
GREEK = ("αλφα", "βήτα", "γάμμα", "δέλτα", "λόγος", "θάλασσα", "ήλιος", "φως", "νερό", "πόλη")
SCRIPTS = ("latin", "upper", "digits", "mixed", "greek")
SCRIPT_P = (0.35, 0.15, 0.2, 0.2, 0.1)
NOISE = {"none": 0.0, "low": 8.0, "high": 20.0}
DARK_SHARE = 0.015


def fetch_model(out: Path) -> dict:
    """Download the wheel (pip download --no-deps), check its sha256, extract the recognizer and its dictionary.

    Returns:
        {"wheel": file name, "wheel_sha256": ..., "model_sha256": ..., "characters": number of characters}.

    Raises:
        SystemExit: pip failed, or the wheel's sha256 is not WHEEL_SHA256 (nothing is read from it then).
    """
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", tmp], check=True)
        wheel = Path(tmp) / WHEEL_FILE
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            raise SystemExit(f"{wheel.name}: sha256 {digest}, expected {WHEEL_SHA256}; not used")
        with zipfile.ZipFile(wheel) as z:
            data = z.read(REC_MEMBER)
    (out / "ppocr_rec.onnx").write_bytes(data)
    model = onnx.load_from_string(data)
    chars = next(p.value for p in model.metadata_props if p.key == "character").splitlines()
    (out / "characters.txt").write_text("\n".join(chars) + "\n", encoding="utf-8")
    return {"wheel": WHEEL_FILE, "wheel_sha256": digest, "model_sha256": hashlib.sha256(data).hexdigest(),
            "characters": len(chars)}


def _text(script: str, rng: np.random.Generator) -> str:
    if script == "digits":
        kind = rng.integers(3)
        return (f"{rng.integers(1, 31):02d}.{rng.integers(1, 13):02d}.{rng.integers(1990, 2030)}" if kind == 0 else
                f"{rng.integers(0, 10000)}.{rng.integers(0, 100):02d}" if kind == 1 else
                str(rng.integers(10 ** 5, 10 ** 9)))
    if script == "greek":
        return " ".join(rng.choice(GREEK, size=rng.integers(1, 3)))
    words = list(rng.choice(WORDS, size=rng.integers(1, 4)))
    if script == "upper":
        return " ".join(words).upper()
    if script == "mixed":
        return f"{words[0].capitalize()} {rng.integers(1, 999)}{rng.choice(['', '%', '$', ':', '-7'])}"
    return " ".join(words)


def render(text: str, font: str, size: int, noise: str, dark: bool, rng: np.random.Generator) -> np.ndarray:
    """One text line as the recognizer's input: (3, 48, 320) float32 in [-1, 1] (rapidocr's normalisation
    (x / 255 - 0.5) / 0.5), the line resized to height 48 keeping its aspect ratio, padded right with 0."""
    from PIL import Image, ImageDraw, ImageFont

    face = ImageFont.truetype(str(FONT_DIR / f"{font}.ttf"), size)
    left, top, right, bottom = face.getbbox(text)
    w, h = right - left + 8, bottom - top + 8
    fg, bg = (235, 25) if dark else (20, 245)
    img = Image.new("L", (w, h), bg)
    ImageDraw.Draw(img).text((4 - left, 4 - top), text, font=face, fill=fg)
    new_w = min(WIDTH, max(8, int(round(w * HEIGHT / h))))
    img = img.resize((new_w, HEIGHT), Image.BILINEAR)
    a = np.asarray(img, dtype=np.float32)
    if NOISE[noise]:
        a = np.clip(a + rng.normal(scale=NOISE[noise], size=a.shape), 0, 255)
    x = np.zeros((3, HEIGHT, WIDTH), dtype=np.float32)
    x[:, :, :new_w] = ((a / 255.0 - 0.5) / 0.5)[None]
    return x


def rows(n: int, seed: int):
    """n rendered lines with their metadata: (inputs (n, 3 * 48 * 320) float32, metadata dict of lists)."""
    rng = np.random.default_rng(seed)
    xs, meta = [], {"script": [], "font": [], "size": [], "noise": [], "background": [], "text": []}
    for _ in range(n):
        script = str(rng.choice(SCRIPTS, p=SCRIPT_P))
        font, size = str(rng.choice(FONTS)), int(rng.integers(16, 41))
        noise, dark = str(rng.choice(list(NOISE), p=(0.5, 0.3, 0.2))), bool(rng.random() < DARK_SHARE)
        text = _text(script, rng)
        xs.append(render(text, font, size, noise, dark, rng).reshape(-1))
        for k, v in zip(meta, (script, font, size, noise, "dark" if dark else "light", text)):
            meta[k].append(v)
    return np.stack(xs), meta


def write(path: Path, x: np.ndarray, meta: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    col = pa.array(x.reshape(-1), type=pa.float32())
    for size in (WIDTH, HEIGHT, 3):  # nested lists: each row's x is a (3, 48, 320) array
        col = pa.FixedSizeListArray.from_arrays(col, size)
    pq.write_table(pa.table({"x": col, **meta}), path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=HERE / "data")
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not FONT_DIR.is_dir():
        raise SystemExit(f"{FONT_DIR} is missing: apt-get install fonts-dejavu-core")
    facts = fetch_model(args.out)
    x, meta = rows(args.rows, args.seed)
    write(args.out / "validation.parquet", x, meta)
    xc, mc = rows(64, args.seed + 1)
    write(args.out / "calibration.parquet", xc, mc)
    (args.out / "wheel.json").write_text(json.dumps(facts, indent=2) + "\n")
    print(f"wrote {args.out}: ppocr_rec.onnx ({facts['characters']} characters), {args.rows} validation rows, "
          f"64 calibration rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
