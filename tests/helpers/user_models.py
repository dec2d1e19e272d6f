"""Models a new user brings, with their data and specs: inputs other than token ids (issue 13).

- `DigitsCNN`: a small CNN image classifier on scikit-learn's `load_digits` (1797 grey 8x8 images, 10 classes),
  input `image` float32 (batch, 1, 8, 8) scaled to [0, 1], output `logits` float32 (batch, 10). `train_digits_cnn`
  trains it for a few epochs (about a second on one core; ~97% held-out accuracy).
- `FrameClassifier`: a small audio-like sequence classifier: input `frames` float32 (batch, sequence, 80) (a
  log-mel-like frame of 80 bands per time step, variable length, padded per batch) and `frame_mask` int64
  (batch, sequence) (1 real frame, 0 padding), output `logits` float32 (batch, 4); masked mean pooling, so
  padding never changes a row's output. `train_frame_classifier` trains it on synthetic frames whose class is
  the band where the energy sits (`frames_frame`).

Data files are Parquet, one row per sample: the input column as nested lists (`list<list<...>>`) or as an Arrow
fixed-shape tensor (`pa.fixed_shape_tensor`), a `label` column and a `digit`/`n_frames` metadata column.

Reuse (a later end-to-end test)::

    from tests.helpers.user_models import train_digits_cnn, write_digits, digits_spec, export_digits_onnx
    model, split = train_digits_cnn()
    write_digits(root / "validation.parquet", *split["validation"], layout="tensor")
    onnx_path = export_digits_onnx(model, root / "digits.onnx")
    spec_doc = digits_spec(registered_name="digits-cnn", validation="validation.parquet", ...)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch

DIGITS_SHAPE = (1, 8, 8)
N_DIGITS = 10
N_BANDS, N_CLASSES_SEQ = 80, 4
DIGITS_CLASS_PATH = "tests.helpers.user_models:DigitsCNN"
FRAMES_CLASS_PATH = "tests.helpers.user_models:FrameClassifier"


# ----------------------------------------------------------------------------------------------- CNN
class DigitsCNN(torch.nn.Module):
    """Conv(1->8, 3x3) ReLU Conv(8->16, 3x3) ReLU MaxPool(2) Flatten Linear(256->10).

    forward(image: float32 (batch, 1, 8, 8)) -> logits float32 (batch, 10).
    """

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2)
        self.fc = torch.nn.Linear(2 * channels * 4 * 4, N_DIGITS)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(image))
        h = self.pool(torch.relu(self.conv2(h)))
        return self.fc(torch.flatten(h, 1))


class FrameClassifier(torch.nn.Module):
    """Linear(80->32) ReLU per frame, mean over the real frames (frame_mask), Linear(32->4).

    forward(frames: float32 (batch, sequence, 80), frame_mask: int64 (batch, sequence)) -> logits float32
    (batch, 4). Padded frames (mask 0) do not change a row's logits.
    """

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.frame = torch.nn.Linear(N_BANDS, hidden)
        self.head = torch.nn.Linear(hidden, N_CLASSES_SEQ)

    def forward(self, frames: torch.Tensor, frame_mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.frame(frames))
        m = frame_mask.to(h.dtype).unsqueeze(-1)
        pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return self.head(pooled)


def digits_split(*, seed: int = 0, n_calibration: int = 200, n_validation: int = 400
                 ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """load_digits split into train / calibration / validation.

    Returns:
        {"train" | "calibration" | "validation": (images float32 (rows, 1, 8, 8) in [0, 1], labels int64 (rows,))}.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0).reshape(-1, *DIGITS_SHAPE)
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    val, cal, train = (order[:n_validation], order[n_validation:n_validation + n_calibration],
                       order[n_validation + n_calibration:])
    return {"train": (x[train], y[train]), "calibration": (x[cal], y[cal]), "validation": (x[val], y[val])}


def _fit(model: Any, batches: Any, epochs: int, lr: float) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for args, y in batches():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(*args), y)
            loss.backward()
            opt.step()
    model.eval()


def train_digits_cnn(*, epochs: int = 6, seed: int = 0) -> tuple[Any, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Train `DigitsCNN` on the train split of `digits_split(seed=seed)` (Adam, lr 1e-2, batch 64).

    Returns:
        (the model in eval mode, the split).
    """
    torch.manual_seed(seed)
    split = digits_split(seed=seed)
    x, y = (torch.from_numpy(a) for a in split["train"])
    rng = np.random.default_rng(seed)

    def batches():
        order = rng.permutation(len(y))
        for i in range(0, len(order), 64):
            idx = torch.from_numpy(order[i:i + 64])
            yield (x[idx],), y[idx]

    model = DigitsCNN()
    _fit(model, batches, epochs, 1e-2)
    return model, split


def write_digits(path: str | Path, images: np.ndarray, labels: np.ndarray, *,
                 layout: Literal["nested", "tensor"] = "nested") -> Path:
    """Write digits rows to Parquet: `image` ((1, 8, 8) per row, float32) as nested lists (list<list<list<float>>>)
    or as an Arrow fixed-shape tensor column; `label` int64; `digit` str (the label as a slice column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = np.ascontiguousarray(images, dtype=np.float32)
    if layout == "tensor":
        col = pa.FixedShapeTensorArray.from_numpy_ndarray(images)
    else:
        col = pa.array([im.tolist() for im in images], type=pa.list_(pa.list_(pa.list_(pa.float32()))))
    table = pa.table({"image": col, "label": pa.array(labels, pa.int64()),
                      "digit": pa.array([str(int(v)) for v in labels])})
    path = Path(path)
    pq.write_table(table, path)
    return path


def export_digits_onnx(model: Any, path: str | Path, *, opset: int = 17) -> Path:
    """Export `model` to ONNX with input `image` (batch, 1, 8, 8) and output `logits` (batch, 10), batch dynamic
    (through tailguard's own exporter, `components.export.logic.export_onnx`)."""
    from tailguard.components.export.logic import dummy_feeds, export_onnx
    from tailguard.core.spec.model import ModelSpec

    spec = ModelSpec.model_validate(digits_model_doc("digits-cnn", opset=opset))
    export_onnx(model, spec, dummy_feeds(spec), path)
    return Path(path)


def digits_model_doc(registered_name: str, *, opset: int = 17) -> dict[str, Any]:
    """The spec's `model` section for the digits CNN (task classification)."""
    return {"registered_name": registered_name, "task": "classification",
            "inputs": [{"name": "image", "dtype": "float32", "shape": ["batch", *DIGITS_SHAPE],
                        "value_range": [0.0, 1.0]}],
            "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", N_DIGITS]}],
            "export": {"opset": opset}}


def digits_spec(*, registered_name: str, validation: str, calibration: str, variants: list[dict] | None = None,
                per_class_min: float = 0.8, **extra: Any) -> dict[str, Any]:
    """A full spec document for the digits CNN: slices by `digit`, an overall top-1 agreement gate and a per-class
    one (`scope: per_slice`, `slice: digit`), FP32 / INT8 dynamic / INT8 static variants (default graph
    optimization: INT8 builds quantize before ORT fuses), a 3-iteration benchmark (no latency gate)."""
    doc: dict[str, Any] = {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "digits-cnn"},
        "model": digits_model_doc(registered_name),
        "data": {"calibration": {"uri": calibration, "max_samples": 64, "batch_size": 16},
                 "validation": {"uri": validation, "label_column": "label", "batch_size": 64}},
        "slices": [{"name": "digit", "column": "digit"}],
        "variants": variants or [
            {"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"},
            {"name": "ort-int8-dynamic", "backend": "onnxruntime", "precision": "int8",
             "quantization": {"mode": "dynamic"}},
            {"name": "ort-int8-static", "backend": "onnxruntime", "precision": "int8",
             "quantization": {"mode": "static", "calibration_method": "minmax", "per_channel": True}}],
        "gates": [{"metric": "top1_agreement", "min": 0.9},
                  {"metric": "top1_agreement", "scope": "per_slice", "slice": "digit", "min": per_class_min,
                   "min_support": 10}],
        "analysis": {"discovery": {"enabled": False}},
        "benchmark": {"batch_sizes": [1, 16], "warmup": 1, "iterations": 3, "max_seconds": 1.0},
        "promotion": {"alias": "production"},
    }
    doc.update(extra)
    return doc


# ------------------------------------------------------------------------------------------ sequences
def frames_frame(n_rows: int, *, seed: int = 0, min_frames: int = 1, max_frames: int = 24) -> pd.DataFrame:
    """Synthetic audio-like rows: `frames` (n_frames, 80) float32 (noise plus energy in the class's band of 20
    bands), `frame_mask` (n_frames,) int64 ones, `label` int64 in [0, 4), `n_frames` int64 in
    [min_frames, max_frames]."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_rows):
        label = int(rng.integers(0, N_CLASSES_SEQ))
        n = int(rng.integers(min_frames, max_frames + 1))
        f = rng.normal(0.0, 1.0, size=(n, N_BANDS)).astype(np.float32)
        band = slice(label * 20, label * 20 + 20)
        f[:, band] += rng.uniform(0.5, 1.5, size=(n, 1)).astype(np.float32)
        rows.append({"frames": f, "frame_mask": np.ones(n, np.int64), "label": label, "n_frames": n})
    return pd.DataFrame(rows)


def write_frames(path: str | Path, frame: pd.DataFrame) -> Path:
    """Write `frames_frame` rows to Parquet: `frames` as list<list<float>> (n_frames lists of 80; a row given as a
    Python list of lists is written as is, ragged or not), `frame_mask` as list<int64>, `label`, `n_frames`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "frames": pa.array([f.tolist() if isinstance(f, np.ndarray) else f for f in frame["frames"]],
                           type=pa.list_(pa.list_(pa.float32()))),
        "frame_mask": pa.array([m.tolist() for m in frame["frame_mask"]], type=pa.list_(pa.int64())),
        "label": pa.array(frame["label"].to_numpy(), pa.int64()),
        "n_frames": pa.array(frame["n_frames"].to_numpy(), pa.int64())})
    path = Path(path)
    pq.write_table(table, path)
    return path


def train_frame_classifier(frame: pd.DataFrame, *, epochs: int = 8, seed: int = 0) -> Any:
    """Train `FrameClassifier` on `frames_frame` rows (Adam, lr 1e-2, batches of 32 padded per batch)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    frames, labels = list(frame["frames"]), frame["label"].to_numpy()

    def batches():
        order = rng.permutation(len(frames))
        for i in range(0, len(order), 32):
            idx = order[i:i + 32]
            longest = max(len(frames[j]) for j in idx)
            x = np.zeros((len(idx), longest, N_BANDS), np.float32)
            m = np.zeros((len(idx), longest), np.int64)
            for k, j in enumerate(idx):
                x[k, :len(frames[j])] = frames[j]
                m[k, :len(frames[j])] = 1
            yield (torch.from_numpy(x), torch.from_numpy(m)), torch.from_numpy(labels[idx])

    model = FrameClassifier()
    _fit(model, batches, epochs, 1e-2)
    return model


def frames_model_doc(registered_name: str = "frames-clf") -> dict[str, Any]:
    """The spec's `model` section for the frame classifier (task classification)."""
    return {"registered_name": registered_name, "task": "classification",
            "inputs": [{"name": "frames", "dtype": "float32", "shape": ["batch", "sequence", N_BANDS]},
                       {"name": "frame_mask", "dtype": "int64", "shape": ["batch", "sequence"],
                        "value_range": [0, 1]}],
            "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", N_CLASSES_SEQ]}]}


def frames_spec(*, validation: str, calibration: str, **extra: Any) -> dict[str, Any]:
    """A full spec document for the frame classifier (slices by length bins of `n_frames`)."""
    doc: dict[str, Any] = {
        "apiVersion": "tailguard/v1", "kind": "OptimizationSpec", "metadata": {"name": "frames-clf"},
        "model": frames_model_doc(),
        "data": {"calibration": {"uri": calibration, "batch_size": 16},
                 "validation": {"uri": validation, "label_column": "label", "batch_size": 32}},
        "slices": [{"name": "length", "column": "n_frames", "bins": [0, 8, 16, 64]}],
        "variants": [{"name": "ort-fp32", "backend": "onnxruntime", "precision": "fp32"}],
        "gates": [{"metric": "top1_agreement", "min": 0.9}],
        "benchmark": {"batch_sizes": [1, 8], "warmup": 1, "iterations": 3, "max_seconds": 1.0},
    }
    doc.update(extra)
    return doc
