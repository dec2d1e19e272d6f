"""A local, content-addressed cache for the pure steps (export, build-<variant>, reference-pass).

A pure step's output is a function of its inputs only: the model bytes, the spec sections the step reads, the
data files it reads and the code and library versions that run it. `cache_key` hashes exactly those; an entry
holds the step's output folder and its result JSON, so a re-run with one gate changed copies the built variants
instead of building them again (the idea of KFP's execution cache and Olive's pass cache, `cache_dir`).

Layout under $TAILGUARD_HOME/cache:

    entries/<key>/files/...      the step's output folder, as the step wrote it
    entries/<key>/result.json    the step's result; paths inside the output folder stored as ${OUT}/...
    entries/<key>/entry.json     step, label, bytes, created (epoch s); its mtime is the entry's last use
    tmp/<key>.<pid>.<hex>/       an entry being written: renamed into entries/ when complete, so a reader never
                                 sees a half-written entry; one left by a killed process is removed by `prune`

The cache is on when $TAILGUARD_CACHE is "1": `tailguard run` sets it for its tasks (`--no-cache` sets "0").
A task on a cluster pod, or a step called directly, does not touch it. Its size is bounded by
$TAILGUARD_CACHE_MAX_BYTES (default 5 GiB): after each store the least recently used entries go.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from tailguard.core.digests import dir_sha256, file_sha256
from tailguard.core.errors import InputError
from tailguard.core.home import home

if TYPE_CHECKING:
    from tailguard.core.reference import ResolvedModel
    from tailguard.core.spec.root import Spec

ENV_CACHE = "TAILGUARD_CACHE"
ENV_MAX_BYTES = "TAILGUARD_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 5 * 1024**3
FORMAT = 1  # bump when the entry layout or the meaning of a key changes
OUT_TOKEN = "${OUT}"
# Libraries whose version changes what a pure step writes (distribution names).
VERSIONED = ("onnxruntime", "onnxruntime-gpu", "onnx", "torch", "numpy", "tensorrt")


def enabled() -> bool:
    """Whether tasks use the cache: $TAILGUARD_CACHE == "1" (set by `tailguard run` unless --no-cache)."""
    return os.environ.get(ENV_CACHE, "0").strip().lower() in ("1", "true", "on", "yes")


def cache_dir() -> Path:
    """$TAILGUARD_HOME/cache (created)."""
    p = home() / "cache"
    p.mkdir(parents=True, exist_ok=True)
    return p


def max_bytes() -> int:
    """The size bound in bytes: $TAILGUARD_CACHE_MAX_BYTES, default 5 GiB.

    Raises:
        InputError: the variable is not a non-negative integer.
    """
    raw = os.environ.get(ENV_MAX_BYTES, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise InputError(f"${ENV_MAX_BYTES}={raw!r} is not a size in bytes",
                         hint=f"set {ENV_MAX_BYTES} to a whole number of bytes, e.g. 2000000000, or unset it")
    return n


# ------------------------------------------------------------------------------------------------- keys
def data_sha256(uri: str) -> str | None:
    """SHA-256 of a local data file; None for a remote URI (s3://...): a step reading one is not cached."""
    if "://" in uri and not uri.startswith("file://"):
        return None
    p = Path(uri.removeprefix("file://"))
    return file_sha256(p) if p.is_file() else None


@functools.lru_cache(maxsize=1)
def code_sha256() -> str:
    """SHA-256 of tailguard's own source (every .py file of the installed package but the monitor): an edit of
    an editable install invalidates the cache as a release would."""
    import tailguard

    root = Path(tailguard.__file__).resolve().parent
    files = [p for p in root.rglob("*.py") if "monitoring" not in p.relative_to(root).parts]
    import importlib.util

    # Located, not imported by name in an import statement: the kernel imports no component (docs/architecture.md).
    found = importlib.util.find_spec("tailguard.components")
    croot = Path(found.origin).resolve().parent
    if not str(croot).startswith(str(root)):  # the source layout: components/ beside pipelines/
        files += list(croot.rglob("*.py"))
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(str(p.name).encode() + b"\0" + p.read_bytes() + b"\n")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """tailguard's version and source hash, Python's, and those of the libraries in VERSIONED ("" = absent)."""
    import platform
    from importlib import metadata

    import tailguard

    out = {"tailguard": tailguard.__version__, "tailguard_code": code_sha256(),
           "python": platform.python_version(), "machine": platform.machine()}
    for dist in VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = ""
    return out


def cache_key(step: str, parts: Mapping[str, Any]) -> str:
    """The key of a step's output: hex SHA-256 of canonical JSON of (FORMAT, step, parts, `versions()`).

    Args:
        step: the step's name ("export", "build", "reference-pass").
        parts: what the step reads, JSON-serializable: model/data SHA-256s, spec sections (model_dump(mode="json")).
    """
    doc = {"format": FORMAT, "step": step, "parts": parts, "versions": versions()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


# Key parts shared by several steps (export, reference-pass): kept here, in the kernel, because a component
# imports no other component (docs/architecture.md, Layers).
def reference_parts(resolved: ResolvedModel, spec: Spec) -> dict[str, Any] | None:
    """What identifies the FP32 reference, for cache keys: its format, files and their bytes, the torch class it
    loads with (and the source file of that class's module), and the model section (exported shapes, export
    settings, pad values).

    Args:
        resolved: the resolved reference (`tailguard.core.reference.ResolvedModel`).
        spec: the validated spec.

    Returns:
        The parts, or None (no caching) when the reference names a class whose module's source file cannot be
        found: an edit of that class could not be seen. Modules the class's module imports are not hashed.
    """
    parts: dict[str, Any] = {
        "format": resolved.format, "model_file": resolved.model_file, "sha256": resolved.sha256,
        "files": dir_sha256(resolved.local_dir), "class_path": resolved.class_path,
        "init_kwargs": resolved.init_kwargs,
        "model": spec.model.model_dump(mode="json", exclude={"version", "registered_name"}),
    }
    if resolved.class_path:
        import importlib.util

        from tailguard.core.torch_load import add_model_path

        add_model_path()  # the folders a model class is imported from
        try:
            found = importlib.util.find_spec(resolved.class_path.split(":")[0])
        except (ImportError, ValueError):
            found = None
        if found is None or not found.origin or not Path(found.origin).is_file():
            return None
        parts["class_source"] = file_sha256(found.origin)
    return parts


def dataset_parts(section: Any) -> dict[str, Any] | None:
    """A data section (`data.validation`, `data.calibration`) without its URI, plus the file's SHA-256; None for
    a remote file (the step reading it is not cached)."""
    digest = data_sha256(section.uri)
    if digest is None:
        return None
    return {**section.model_dump(mode="json", exclude={"uri"}), "sha256": digest}


@functools.lru_cache(maxsize=1)
def machine_parts() -> dict[str, Any]:
    """The machine, for the keys of steps whose results hold timings (reference-pass's baselines): the CPU model
    (/proc/cpuinfo's "model name", else `platform.processor()`), the logical CPU count, the OS and the
    architecture. A cached timing is served only on a machine that reads the same."""
    import platform

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu or platform.processor(), "cpus": os.cpu_count(), "system": platform.system(),
            "machine": platform.machine()}


# ---------------------------------------------------------------------------------------------- entries
@dataclass
class CacheEntry:
    """One complete entry.

    Attributes:
        key: its key (64 hex chars).
        step: the step that wrote it.
        label: what it is, for `tailguard cache ls` (e.g. "build ort-int8").
        bytes: size of its files, bytes.
        created: when it was stored (epoch seconds).
        last_used: when it was stored or last restored (epoch seconds).
        path: its folder.
    """

    key: str
    step: str
    label: str
    bytes: int
    created: float
    last_used: float
    path: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return asdict(self)


def _entries_root() -> Path:
    return cache_dir() / "entries"


def _read_entry(folder: Path) -> CacheEntry | None:
    meta = folder / "entry.json"
    try:
        d = json.loads(meta.read_text())
        return CacheEntry(key=folder.name, step=d.get("step", ""), label=d.get("label", ""),
                          bytes=int(d.get("bytes", 0)), created=float(d.get("created", 0)),
                          last_used=meta.stat().st_mtime, path=str(folder))
    except (OSError, ValueError):
        return None


def lookup(key: str) -> CacheEntry | None:
    """The complete entry for `key`, or None."""
    folder = _entries_root() / key
    if not (folder / "result.json").is_file():
        return None
    return _read_entry(folder)


def entries() -> list[CacheEntry]:
    """Every complete entry, most recently used first."""
    root = _entries_root()
    found = [e for e in (_read_entry(p) for p in root.iterdir()) if e is not None] if root.is_dir() else []
    return sorted(found, key=lambda e: e.last_used, reverse=True)


def _copy_file(src: Path, dst: Path) -> None:
    """Copy one file (the seam tests interrupt to prove a store is atomic)."""
    shutil.copy2(src, dst)


def _copy_tree(src: Path, dst: Path) -> int:
    """Copy the files under `src` to `dst` (created); returns the bytes copied."""
    total = 0
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.rglob("*")):
        target = dst / p.relative_to(src)
        if p.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif p.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _copy_file(p, target)
            total += p.stat().st_size
    return total


def _relocate(obj: Any, old: str, new: str) -> Any:
    """`obj` with `old` replaced by `new` in every string (paths inside the output folder move with it)."""
    if isinstance(obj, str):
        return obj.replace(old, new)
    if isinstance(obj, list):
        return [_relocate(v, old, new) for v in obj]
    if isinstance(obj, dict):
        return {k: _relocate(v, old, new) for k, v in obj.items()}
    return obj


def store(key: str, out_dir: str | Path, result: Mapping[str, Any], *, step: str, label: str = "",
          replace: bool = False) -> CacheEntry:
    """Store `out_dir`'s files and `result` under `key`, atomically: written to tmp/, then renamed into entries/.

    If another process stored the same key first, its entry is kept and this copy dropped, unless `replace`: then
    the old entry is renamed away and this one takes its place (an entry that grows, e.g. a variant's measurements
    extended by more validation rows; a reader between the two renames sees no entry and measures again). An
    interruption (an exception, Ctrl-C) removes the partial copy; a kill -9 leaves it in tmp/, where no lookup
    sees it.

    Returns:
        The entry.
    """
    given, out = str(out_dir), Path(out_dir).resolve()
    tmp = cache_dir() / "tmp" / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    final = _entries_root() / key
    try:
        size = _copy_tree(out, tmp / "files")
        rel = _relocate(_relocate(dict(result), str(out), OUT_TOKEN), given, OUT_TOKEN)
        (tmp / "result.json").write_text(json.dumps(rel, default=str))
        (tmp / "entry.json").write_text(json.dumps({"step": step, "label": label, "bytes": size,
                                                    "created": time.time()}))
        final.parent.mkdir(parents=True, exist_ok=True)
        if replace and final.exists():
            doomed = cache_dir() / "tmp" / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.old"
            try:
                os.rename(final, doomed)
            except OSError:
                pass
            shutil.rmtree(doomed, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:  # another process stored it first (the target exists): keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    entry = lookup(key)
    if entry is None:  # pruned in between by another process: report what was written
        entry = CacheEntry(key, step, label, size, time.time(), time.time(), str(final))
    return entry


def restore(entry: CacheEntry, out_dir: str | Path) -> dict[str, Any]:
    """Copy an entry's files into `out_dir` (created) and return its result with paths rebased onto `out_dir`;
    marks the entry used (its last-use time is now)."""
    out = Path(out_dir).resolve()
    folder = Path(entry.path)
    _copy_tree(folder / "files", out)
    result = json.loads((folder / "result.json").read_text())
    os.utime(folder / "entry.json")
    return _relocate(result, OUT_TOKEN, str(out))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prune(limit: int | None = None) -> list[CacheEntry]:
    """Remove the least recently used entries until the rest take at most `limit` bytes (default `max_bytes()`),
    and the partial entries in tmp/ of processes that are gone. Returns the entries removed."""
    limit = max_bytes() if limit is None else limit
    tmp_root = cache_dir() / "tmp"
    if tmp_root.is_dir():
        for t in tmp_root.iterdir():
            try:
                pid = int(t.name.split(".")[1])
            except (IndexError, ValueError):
                pid = -1
            if pid != os.getpid() and (pid < 0 or not _pid_alive(pid)):
                shutil.rmtree(t, ignore_errors=True)
    removed = []
    kept = entries()
    total = sum(e.bytes for e in kept)
    for e in reversed(kept):  # least recently used first
        if total <= limit:
            break
        # rename first: a reader never copies from a folder being deleted
        doomed = cache_dir() / "tmp" / f"{e.key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        doomed.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(e.path, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        total -= e.bytes
        removed.append(e)
    return removed


# ------------------------------------------------------------------------------------------- the wrapper
def cached_step(step: str, parts: Mapping[str, Any] | None, out_dir: str | Path,
                run: Callable[[], dict[str, Any]], *, label: str = "",
                cacheable: Callable[[dict[str, Any]], bool] = lambda r: True) -> dict[str, Any]:
    """Run a pure step through the cache.

    When the cache is on (`enabled()`) and `parts` is not None: a hit copies the entry's files into `out_dir`
    and returns its result with `cached: true`; a miss runs `run()` (which writes `out_dir` and returns the
    result), stores the entry when `cacheable(result)` (e.g. only status ok: a skipped TensorRT build depends on
    the machine), prunes to the size bound, and returns the result with `cached: false`. When off, or `parts` is
    None (an input that cannot be hashed, such as a remote data file), it only runs `run()`.

    Args:
        step: the step's name (part of the key).
        parts: what the step reads (see `cache_key`), or None.
        out_dir: the step's output folder.
        run: the step.
        label: shown by `tailguard cache ls`.
        cacheable: whether a result may be stored.

    Returns:
        The step's result dict, with "cached" added.
    """
    if not enabled() or parts is None:
        return {**run(), "cached": False}
    key = cache_key(step, parts)
    entry = lookup(key)
    if entry is not None:
        try:
            return {**restore(entry, out_dir), "cached": True}
        except OSError:  # pruned while we copied: build it
            pass
    result = run()
    if cacheable(result):
        try:
            store(key, out_dir, {k: v for k, v in result.items() if k != "cached"}, step=step, label=label)
            prune()
        except OSError:  # a full disk must not fail the build: the result is still good
            pass
    return {**result, "cached": False}
