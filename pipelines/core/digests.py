"""SHA-256 digests of files and folders: one helper for every step that fingerprints bytes.

The cache keys (`tailguard.core.cache`), the reference's and an artifact's recorded sha256
(`tailguard.core.reference`, `tailguard.core.artifacts`), the registry's `tailguard.sha256` /
`tailguard.files_sha256` tags (`tailguard.fetch`) and the monitor's same-file check all hash with these, so a digest
means the same wherever it is compared. Nothing of tailguard above the kernel's contract constants is imported.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def files_sha256(paths: Iterable[Path], root: Path) -> str:
    """Hex SHA-256 over (path relative to `root`, file SHA-256) of `paths`, in sorted order."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(root)).encode() + b"\0" + file_sha256(p).encode() + b"\n")
    return h.hexdigest()


def artifact_files(folder: str | Path) -> list[Path]:
    """The model's own files under a downloaded (or logged) model folder, sorted: every regular file but MLflow's
    packaging files at its top (`contract.MLFLOW_PACKAGING_FILES`)."""
    from tailguard.core.contract import MLFLOW_PACKAGING_FILES

    root = Path(folder)
    return sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0]
                  not in MLFLOW_PACKAGING_FILES)


def artifact_files_sha256(folder: str | Path) -> str:
    """Hex SHA-256 over (relative path, file SHA-256) of `artifact_files(folder)` (`files_sha256`): the value of a
    version's `tailguard.files_sha256` tag."""
    return files_sha256(artifact_files(folder), Path(folder))


def dir_sha256(path: str | Path, *, prefix: str = "") -> str:
    """Hex SHA-256 of every file under `path` (names and bytes); `prefix`: only files whose name starts so."""
    root = Path(path)
    return files_sha256((p for p in root.rglob("*") if p.is_file() and p.name.startswith(prefix)), root)
