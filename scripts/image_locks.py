#!/usr/bin/env python3
"""Write the hashed requirement files of the container images: manifests/images/requirements-<image>.lock.

Each image names what it installs in manifests/images/requirements-<image>.txt (top-level pins, `-r` followed).
This script takes their dependency closure, as the installed distributions' metadata declares it (`Requires-Dist`,
markers evaluated for the image's Python on linux x86_64, extras followed) plus tailguard's build backend
(pyproject.toml [build-system]: the images install tailguard with --no-build-isolation), and copies every
distribution's pin and sha256 hashes from the project's lock (requirements.lock, made by `make lock` with
pip-compile --generate-hashes: every file of each pinned version). The Dockerfiles install the result with
`pip install --require-hashes --no-deps`, so a package whose file differs from the locked one is refused and
nothing unlisted is installed.

Run it with the project's virtualenv (installed from requirements.lock, so its metadata is the lock's):

    .venv/bin/python scripts/image_locks.py           # rewrite the .lock files
    .venv/bin/python scripts/image_locks.py --check   # exit 1 when one is stale (tests/integration/test_images.py)

Errors (exit 2): a top-level pin that differs from the lock, or a distribution of the closure that the lock or
the virtualenv does not hold.

The GPU image: its CUDA layer (`torch` built for CUDA, `onnxruntime-gpu` and the `nvidia-*` wheels they pull) is
not in requirements.lock, which is resolved on CPU; IMAGES["gpu"].unhashed names it. Its lock holds the hashed
closure of requirements-common.txt for the base image's Python 3.12, and the Dockerfile installs the CUDA layer
after it, pinned by version only (docs/deploy.md says so).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
IMAGES_DIR = ROOT / "manifests" / "images"


@dataclass(frozen=True)
class Image:
    """One image: its top-level requirements file, the Python of its base image, and the top-level distributions
    left out of its lock (installed after it, unhashed)."""

    requirements: str
    python: str
    unhashed: frozenset[str] = field(default_factory=frozenset)


IMAGES = {
    "cpu": Image("requirements-cpu.txt", "3.11"),  # python:3.11.x-slim-bookworm
    "monitor": Image("requirements-monitor.txt", "3.11"),
    # nvcr.io/nvidia/tensorrt:25.01-py3: Ubuntu 24.04, Python 3.12
    "gpu": Image("requirements-gpu.txt", "3.12", frozenset({"torch", "onnxruntime-gpu"})),
}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;#\\]+)")


class LockError(Exception):
    """The images' requirements do not fit the lock (exit 2)."""


def norm(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path = LOCK) -> dict[str, tuple[str, list[str]]]:
    """{normalized name: (version, [hash lines as written])} of a pip-compile --generate-hashes file."""
    out: dict[str, tuple[str, list[str]]] = {}
    current: str | None = None
    for raw in path.read_text().splitlines():
        m = _PIN.match(raw)
        if m:
            current = norm(m.group(1))
            out[current] = (m.group(3), [])
            continue
        line = raw.strip()
        if current and line.startswith("--hash="):
            out[current][1].append(line.rstrip(" \\"))
        elif not raw.startswith(" "):
            current = None
    return out


def index_options(path: Path) -> list[str]:
    """The `--index-url` / `--extra-index-url` lines of a requirements file, `-r` followed, in order."""
    out: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("-r "):
            out += [o for o in index_options(path.parent / line[3:].strip()) if o not in out]
        elif line.startswith(("--index-url", "--extra-index-url")) and line not in out:
            out.append(line)
    return out


def build_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """Normalized names of pyproject.toml's [build-system] requires: the images install tailguard itself with
    --no-build-isolation, so its build backend comes from the hashed lock too."""
    import tomllib
    from packaging.requirements import Requirement

    return [norm(Requirement(r).name) for r in tomllib.loads(pyproject.read_text())["build-system"]["requires"]]


def top_level(path: Path) -> dict[str, str]:
    """{normalized name: pinned version} of a requirements file, `-r` followed; options and comments skipped."""
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("-r "):
            pins.update(top_level(path.parent / line[3:].strip()))
            continue
        m = _PIN.match(line)
        if m:
            pins[norm(m.group(1))] = m.group(3)
    return pins


def _environment(python: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "platform_release": "", "platform_version": "", "implementation_version": python + ".0", "extra": ""}


def closure(roots: list[str], python: str) -> set[str]:
    """The normalized names of `roots` and everything they require on `python` (linux x86_64), from the installed
    distributions' metadata, extras followed.

    Raises:
        LockError: a required distribution is not installed here.
    """
    from packaging.requirements import Requirement

    env = _environment(python)
    extras_of: dict[str, set[str]] = {}
    todo: list[tuple[str, frozenset[str]]] = [(r, frozenset()) for r in roots]
    while todo:
        name, extras = todo.pop()
        known = extras_of.get(name)
        if known is not None and extras <= known:
            continue
        contexts = ([""] if known is None else []) + sorted(extras - (known or set()))  # what is new to follow
        extras_of[name] = (known or set()) | set(extras)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise LockError(f"{name} is required but not installed in this virtualenv (make .venv)") from None
        for spec in dist.requires or []:
            req = Requirement(spec)
            if any(req.marker is None and e == "" or req.marker is not None and req.marker.evaluate({**env,
                                                                                                  "extra": e})
                   for e in contexts):
                todo.append((norm(req.name), frozenset(req.extras)))
    return set(extras_of)


def render(image: str, lock: dict[str, tuple[str, list[str]]]) -> str:
    """The text of manifests/images/requirements-<image>.lock.

    Raises:
        LockError: a top-level pin differs from the lock, or a distribution of the closure has no locked pin.
    """
    spec = IMAGES[image]
    pins = top_level(IMAGES_DIR / spec.requirements)
    problems = []
    for name, version in sorted(pins.items()):
        if name in spec.unhashed:
            continue
        if name not in lock:
            problems.append(f"{spec.requirements}: {name} is not in requirements.lock")
        elif lock[name][0] != version:
            problems.append(f"{spec.requirements}: {name}=={version} but requirements.lock has {lock[name][0]}")
    if problems:
        raise LockError("; ".join(problems))
    names = closure([n for n in pins if n not in spec.unhashed] + build_requirements(), spec.python)
    missing = sorted(n for n in names if n not in lock)
    if missing:
        raise LockError(f"{image}: {missing} are required (Python {spec.python}) but not in requirements.lock")
    lines = [f"# GENERATED by scripts/image_locks.py from {spec.requirements} and requirements.lock: do not edit.",
             f"# The {image} image's whole dependency closure for Python {spec.python} on linux x86_64, each "
             "distribution with",
             "# its sha256 hashes: pip install --require-hashes --no-deps -r this file."]
    if spec.unhashed:
        lines.append(f"# Not here (installed after, pinned by version in {spec.requirements}): "
                     f"{', '.join(sorted(spec.unhashed))}.")
    lines += index_options(IMAGES_DIR / spec.requirements)
    for name in sorted(names):
        version, hashes = lock[name]
        lines.append(f"{name}=={version} \\")
        lines.extend(f"    {h} \\" if i < len(hashes) - 1 else f"    {h}" for i, h in enumerate(hashes))
    return "\n".join(lines) + "\n"


def lock_path(image: str) -> Path:
    """manifests/images/requirements-<image>.lock"""
    return IMAGES_DIR / f"requirements-{image}.lock"


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, compare) every image's lock file; 0 ok, 1 stale (--check), 2 does not fit."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a lock file differs from what it would be")
    args = parser.parse_args(argv)
    lock = read_lock()
    stale = []
    for image in IMAGES:
        try:
            text = render(image, lock)
        except LockError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        path = lock_path(image)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)} ({text.count('==')} distributions)")
    if stale:
        print(f"stale: {', '.join(stale)}; run .venv/bin/python scripts/image_locks.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
