"""The layers of tailguard (docs/architecture.md, Layers), checked on the source with `ast`.

Units: core (`tailguard.core.*`), each component
(`tailguard.components.<name>`; `tailguard.components.images` is shared), monitoring (`tailguard.monitoring.*`) and
the application (every other `tailguard.*` module: pipeline, runner, cli, demo, ...). Every import statement counts,
at module level and inside functions, `import x` and `from x import y`, relative ones resolved. Imports by string
(`importlib.import_module(...)`, the builder registry's module names) are not import statements and do not count.

Rules:
- core imports no other unit, and each of its modules is imported by two or more units (a module only the kernel
  imports counts the units of its kernel importers): single-user code lives beside its user;
- a component imports core, `components.images` and nothing of another component, except the orchestrators: search,
  which may import the public names (no leading underscore) of build and validate, and redecide, of resolve,
  validate and register, but not their task modules (a component's KFP glue); no cycle among components;
- monitoring imports core only;
- the application may import everything, with no import cycle between its modules;
- no import cycle between the modules of one unit either: inside the kernel, inside each component, inside
  monitoring (function-level "lazy" imports and `if TYPE_CHECKING:` imports count: a cycle hidden in a function is
  still two modules that need each other);
- no module imports the private (underscore) names or modules of another unit (core or a component): what
  crosses a unit boundary is public.
Also: pyproject.toml's packages list equals the package folders; no module only re-exports another (an old-path
shim such as `sys.modules[__name__] = tailguard.core.spec`), and every `from tailguard.x import name` (package, tests,
examples, scripts) names the module that defines `name`, not one that merely imports it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
SHARED_COMPONENT_MODULES = {"tailguard.components", "tailguard.components.images"}
# components that may import the public names of others: search (trials are builds and validations) and redecide
# (a gate-only re-run: resolve's parent run, validate's replay and logging, register's registration and promotion)
ORCHESTRATORS = {"search": {"build", "validate"}, "redecide": {"resolve", "validate", "register"}}
# A component's task.py is its KFP glue, not its public API: an orchestrator imports another component's logic
# modules (register/finish.py, resolve/parent_run.py, validate/run_log.py), never its task module (no exception).


def package_dirs() -> dict[str, Path]:
    """pyproject's `[tool.setuptools.package-dir]`: import package name -> folder (tailguard -> pipelines/...)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: ROOT / folder for name, folder in cfg["tool"]["setuptools"]["package-dir"].items()}


def modules() -> dict[str, Path]:
    """Every tailguard module in the source tree: dotted name -> file (packages by their __init__.py)."""
    roots = package_dirs()
    out: dict[str, Path] = {}
    for pkg, folder in roots.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            # a folder inside this one that pyproject maps to its own package name is walked from that name
            if any(f != folder and folder in f.parents and f in path.parents for f in roots.values()):
                continue
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((pkg, *rel))] = path
    return out


def unit(module: str) -> str | None:
    """The layer unit of a tailguard module, or None for a module outside tailguard (and the bare package roots)."""
    parts = module.split(".")
    if parts[0] != "tailguard" or module in {"tailguard"}:
        return None
    if parts[1] == "core":
        return "core"
    if parts[1] == "components":
        if module in SHARED_COMPONENT_MODULES:
            return "components.images"
        return f"components.{parts[2]}"
    if parts[1] == "monitoring":
        return "monitoring"
    return "application"


@dataclass(frozen=True)
class Import:
    """One import statement's target: the importing module, its file and line, the imported module and, for
    `from m import name`, the name."""

    source: str
    path: Path
    line: int
    target: str
    name: str | None


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every import statement in the file (module and function level), relative imports resolved; `from pkg import
    sub` counts as an import of `pkg.sub` when that is a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(module, path, node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append(Import(module, path, node.lineno, sub, None) if sub in known
                           else Import(module, path, node.lineno, target, a.name))
    return [i for i in out if i.target.split(".")[0] == "tailguard"]


def graph() -> list[Import]:
    """All tailguard -> tailguard imports in the source tree."""
    mods = modules()
    known = set(mods)
    return [i for m, p in sorted(mods.items()) for i in imports_of(m, p, known)]


def private_name(imp: Import) -> str | None:
    """The underscore name an import takes (`from m import _x`, or a module `_m`), None for public names and
    dunders."""
    last = imp.name if imp.name is not None else imp.target.rsplit(".", 1)[-1]
    return last if last.startswith("_") and not last.startswith("__") else None


def violation(imp: Import) -> str | None:
    """Why an import breaks the layer rules, or None when it is allowed."""
    src, dst = unit(imp.source), unit(imp.target)
    if src is None or dst is None or src == dst:
        return None
    if dst != "application" and (private := private_name(imp)) is not None:
        what = "the private name" if imp.name is not None else "the private module"
        return f"{src} imports {what} {private} of {dst}"
    if src == "application":
        return None
    if dst == "core":
        return None
    if src == "core":
        return f"core imports {dst}"
    if src == "monitoring":
        return f"monitoring imports {dst}"
    if src.startswith("components.") and dst == "components.images":
        return None
    if dst.split(".")[1] in ORCHESTRATORS.get(src.split(".")[1], ()):
        if imp.target.split(".")[3:4] == ["task"]:
            return f"{src} imports the task module of {dst}"
        return None
    return f"{src} imports {dst}"


def fmt(imp: Import) -> str:
    """file:line: source -> target[.name]."""
    what = imp.target + (f" ({imp.name})" if imp.name else "")
    return f"{imp.path.relative_to(ROOT)}:{imp.line}: {imp.source} -> {what}"


def component_cycles(edges: list[Import]) -> list[list[str]]:
    """Cycles in the component -> component graph (strongly connected components of size > 1)."""
    pairs = [(unit(e.source), unit(e.target)) for e in edges]
    return cycles([(s, d) for s, d in pairs if s and d and s != d and s.startswith("components.")
                   and d.startswith("components.")])


def application_cycles(edges: list[Import]) -> list[list[str]]:
    """Cycles among the application's modules (cli <-> demo was one): module -> module, strongly connected
    components of size > 1."""
    return cycles([(e.source, e.target) for e in edges if e.source != e.target
                   and unit(e.source) == unit(e.target) == "application"])


def cycles(pairs: list[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of size > 1 of the directed graph `pairs` (Tarjan 1972), each sorted."""
    adj: dict[str, set[str]] = {}
    for s, d in pairs:
        adj.setdefault(s, set()).add(d)
        adj.setdefault(d, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(adj[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return out


def test_layout_has_no_upward_import_when_scanning_every_module():
    edges = graph()
    assert len(edges) > 100, "the scan found too few imports: is the package-dir mapping read right?"
    bad = [f"{fmt(e)}: {why}" for e in edges if (why := violation(e))]
    print("\n".join(bad))
    assert not bad, "layer violations (docs/architecture.md, Layers):\n" + "\n".join(bad)


def test_layout_has_no_component_cycle_when_scanning_every_module():
    edges = graph()
    cycles = component_cycles(edges)
    lines = []
    for comp in cycles:
        lines.append(" <-> ".join(comp))
        lines += ["  " + fmt(e) for e in edges
                  if unit(e.source) in comp and unit(e.target) in comp and unit(e.source) != unit(e.target)]
    print("\n".join(lines))
    assert not cycles, "import cycles among components:\n" + "\n".join(lines)


def test_layout_has_no_cycle_between_application_modules_when_scanning_every_module():
    edges = graph()
    found = application_cycles(edges)
    lines = []
    for comp in found:
        lines.append(" <-> ".join(comp))
        lines += ["  " + fmt(e) for e in edges if e.source in comp and e.target in comp and e.source != e.target]
    print("\n".join(lines))
    assert not found, "import cycles among application modules:\n" + "\n".join(lines)


# Cycles inside a unit that are known and allowed, each with its reason; empty since issue 40 (the kernel's
# spec.models <-> presets, cache <-> reference and runtime -> torch_backend -> hardware -> runtime, and validate's
# gates <-> logic, were removed). A new entry needs a reason here and an issue to remove it.
ALLOWED_UNIT_CYCLES: dict[frozenset[str], str] = {}


def unit_cycles(edges: list[Import]) -> list[list[str]]:
    """Cycles among the modules of one unit other than the application (kernel, each component, monitoring):
    module -> module, strongly connected components of size > 1, less `ALLOWED_UNIT_CYCLES`."""
    found = cycles([(e.source, e.target) for e in edges if e.source != e.target
                    and unit(e.source) == unit(e.target) not in (None, "application")])
    return [c for c in found if frozenset(c) not in ALLOWED_UNIT_CYCLES]


def test_layout_has_no_cycle_inside_a_unit_when_scanning_every_module():
    edges = graph()
    found = unit_cycles(edges)
    lines = []
    for comp in found:
        lines.append(" <-> ".join(comp))
        lines += ["  " + fmt(e) for e in edges if e.source in comp and e.target in comp and e.source != e.target]
    print("\n".join(lines))
    assert not found, ("import cycles inside a unit (lazy imports count): move the shared helper down into a "
                       "module both import:\n" + "\n".join(lines))


def test_layout_unit_cycles_counts_lazy_imports_when_given_synthetic_modules(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from tailguard.core.b import g\n\n\ndef f():\n    return g()\n")
    b.write_text("def g():\n    from tailguard.core.a import f  # lazy: hidden from an import-time check\n"
                 "    return f\n")
    c = tmp_path / "c.py"
    c.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from tailguard.components.x.d import D\n")
    d = tmp_path / "d.py"
    d.write_text("from tailguard.components.x.c import C\n")
    known = {"tailguard.core.a", "tailguard.core.b", "tailguard.components.x.c", "tailguard.components.x.d"}
    edges = (imports_of("tailguard.core.a", a, known) + imports_of("tailguard.core.b", b, known)
             + imports_of("tailguard.components.x.c", c, known) + imports_of("tailguard.components.x.d", d, known))
    assert unit_cycles(edges) == [["tailguard.components.x.c", "tailguard.components.x.d"],
                                  ["tailguard.core.a", "tailguard.core.b"]]
    def mk(s, t):
        return Import(s, ROOT / "x.py", 1, t, "x")
    assert unit_cycles([mk("tailguard.components.x.c", "tailguard.components.y.d"),
                        mk("tailguard.components.y.d", "tailguard.components.x.c"),
                        mk("tailguard.cli", "tailguard.demo"), mk("tailguard.demo", "tailguard.cli")]) == []


def kernel_users(edges: list[Import]) -> dict[str, set[str]]:
    """{kernel module: the units (not core) that import it}. A kernel module imported by another kernel module
    counts that module's units too (transitively): `core.presets`, read only by `core.spec`, serves every unit
    that reads the spec. The package root `tailguard.core` is left out."""
    direct: dict[str, set[str]] = {}
    for e in edges:
        if unit(e.target) == "core" and e.target != e.source:
            direct.setdefault(e.target, set()).add(e.source)
    kernel = sorted(m for m in modules() if unit(m) == "core" and m != "tailguard.core")
    memo: dict[str, set[str]] = {}

    def units_of(m: str, seen: frozenset[str]) -> set[str]:
        if m in memo:
            return memo[m]
        out: set[str] = set()
        for src in direct.get(m, ()):
            if unit(src) != "core":
                out.add(unit(src))
            elif src not in seen:
                out |= units_of(src, seen | {src})
        if not seen - {m}:
            memo[m] = out
        return out

    return {m: units_of(m, frozenset({m})) for m in kernel}


def test_layout_kernel_modules_have_two_importing_units_when_scanning_every_module():
    users = kernel_users(graph())
    assert len(users) > 10, "found too few kernel modules: is the package-dir mapping read right?"
    bad = [f"{m}: imported by {sorted(u) or 'no unit'}" for m, u in sorted(users.items()) if len(u) < 2]
    assert not bad, ("kernel modules that fewer than two units import: move each beside its one user "
                     "(docs/architecture.md, Layers):\n" + "\n".join(bad))


def test_layout_kernel_users_counts_units_through_kernel_importers_when_given_synthetic_edges():
    def mk(s, d):
        return Import(s, ROOT / "x.py", 1, d, "x")
    edges = [mk("tailguard.components.build.logic", "tailguard.core.artifacts"),
             mk("tailguard.components.build.task", "tailguard.core.artifacts"),
             mk("tailguard.core.spec", "tailguard.core.presets"),
             mk("tailguard.cli", "tailguard.core.spec"), mk("tailguard.monitoring.config", "tailguard.core.spec")]
    users = kernel_users(edges)
    assert users["tailguard.core.artifacts"] == {"components.build"}
    assert users["tailguard.core.presets"] == {"application", "monitoring"}
    assert users["tailguard.core.stats"] == set()


def test_layout_packages_list_equals_the_package_folders():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(cfg["tool"]["setuptools"]["packages"])
    found = {m for m, p in modules().items() if p.name == "__init__.py"}
    missing, extra = sorted(found - listed), sorted(listed - found)
    assert not missing and not extra, (f"pyproject.toml [tool.setuptools] packages: add {missing}, "
                                       f"remove {extra}")


@pytest.mark.parametrize("src,dst,name,expected", [
    ("tailguard.core.spec", "tailguard.components.validate.report", "x", "core imports components.validate"),
    ("tailguard.monitoring.config", "tailguard.runner", None, "monitoring imports application"),
    ("tailguard.components.register.logic", "tailguard.components.search.logic", "TAG",
     "components.register imports components.search"),
    ("tailguard.components.search.sensitivity", "tailguard.components.build.logic", "_private",
     "components.search imports the private name _private of components.build"),
    ("tailguard.components.search.logic", "tailguard.components.validate.logic", "evaluate", None),
    ("tailguard.components.export.task", "tailguard.components.images", "CPU_IMAGE", None),
    ("tailguard.cli", "tailguard.components.search.logic", "x", None),
    ("tailguard.cli", "tailguard.components.build.logic", "_excluded_nodes",
     "application imports the private name _excluded_nodes of components.build"),
    ("tailguard.components.validate.discovery", "tailguard.core.parity", "_source",
     "components.validate imports the private name _source of core"),
    ("tailguard.monitoring.compare", "tailguard.components._private", None,
     "monitoring imports the private module _private of components._private"),
    ("tailguard.components.build.sensitivity", "tailguard.components.build.logic", "_excluded_nodes", None),
    ("tailguard.core.spec", "tailguard.core.presets", "_x", None),
    ("tailguard.pipeline", "tailguard.core.spec", "x", None),
    ("tailguard.components.redecide.task", "tailguard.components.register.task", "finish_run",
     "components.redecide imports the task module of components.register"),
    ("tailguard.components.redecide.task", "tailguard.components.resolve.task", None,
     "components.redecide imports the task module of components.resolve"),
    ("tailguard.components.redecide.task", "tailguard.components.register.finish", "finish_run", None),
    ("tailguard.components.search.task", "tailguard.components.validate.gates", "verdict", None),
    ("tailguard.components.search.task", "tailguard.components.validate.task", "log_validation",
     "components.search imports the task module of components.validate"),
    ("tailguard.components.redecide.task", "tailguard.components.validate.task", "write_validation_record",
     "components.redecide imports the task module of components.validate"),
    ("tailguard.components.redecide.task", "tailguard.components.validate.run_log", "write_validation_record", None),
    ("tailguard.components.search.task", "tailguard.components.validate.measurements", "load_measurements", None),
])
def test_layout_violation_flags_upward_imports_when_given_synthetic_edges(src, dst, name, expected):
    assert violation(Import(src, ROOT / "x.py", 1, dst, name)) == expected


def test_layout_component_cycles_finds_a_cycle_when_two_components_import_each_other():
    def mk(s, d):
        return Import(s, ROOT / "x.py", 1, d, "x")
    edges = [mk("tailguard.components.export.logic", "tailguard.components.build.logic"),
             mk("tailguard.components.build.logic", "tailguard.components.export.task")]
    assert component_cycles(edges) == [["components.build", "components.export"]]


def test_layout_application_cycles_finds_a_cycle_when_cli_and_demo_import_each_other():
    def mk(s, d):
        return Import(s, ROOT / "x.py", 1, d, "x")
    edges = [mk("tailguard.cli", "tailguard.demo"), mk("tailguard.demo", "tailguard.cli"),
             mk("tailguard.demo", "tailguard.terminal")]
    assert application_cycles(edges) == [["tailguard.cli", "tailguard.demo"]]


def _top_level_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names a module defines at module level: def, class and assignment targets, also under if/try/with; names it
    binds only by module-level import statements). Function and class bodies are not entered."""
    defined: set[str] = set()
    imported: set[str] = set()

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            else:
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return defined, imported - defined


def reexport_only(tree: ast.Module) -> bool:
    """Whether a module only re-exports others: besides its docstring, `from __future__` and `__all__`, every
    module-level statement is an import (or `sys.modules[__name__] = ...`), and at least one imports tailguard."""
    rest = [n for n in tree.body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str))
            and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
            and not (isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["__all__"])]
    swaps = [n for n in rest if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]).startswith("sys.modules[")]
    imports = [n for n in rest if isinstance(n, (ast.Import, ast.ImportFrom))]
    from_tailguard = any((n.module or "").startswith("tailguard") if isinstance(n, ast.ImportFrom)
                         else any(a.name.startswith("tailguard") for a in n.names) for n in imports)
    return bool(rest) and len(imports) + len(swaps) == len(rest) and from_tailguard


def test_layout_has_no_module_that_only_reexports_another_when_scanning_every_module():
    bad = []
    for name, path in sorted(modules().items()):
        tree = ast.parse(path.read_text(), filename=str(path))
        swap = any(isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "sys.modules[__name__]"
                   for n in ast.walk(tree))
        if swap or reexport_only(tree):
            bad.append(f"{path.relative_to(ROOT)} ({name})")
    assert not bad, ("modules that only re-export another (shims): delete them and import the real module:\n"
                     + "\n".join(bad))


@pytest.mark.parametrize("source,expected", [
    ('"""Old path."""\nimport sys\n\nfrom tailguard.core import spec as _m\n\nsys.modules[__name__] = _m\n', True),
    ('"""Names."""\nfrom __future__ import annotations\n\nfrom tailguard.core.stats import Side, wilson_bound\n'
     '__all__ = ["Side", "wilson_bound"]\n', True),
    ('"""Real."""\nfrom tailguard.core.stats import wilson_bound\n\n\ndef f():\n    return wilson_bound(1, 2, 0.9)\n',
     False),
    ('"""A package."""\n', False),
])
def test_layout_reexport_only_flags_shims_when_given_synthetic_modules(source, expected):
    assert reexport_only(ast.parse(source)) is expected


def _python_files() -> list[Path]:
    """The package's modules and the .py files of tests/, examples/, scripts/ and benchmarks/."""
    extra = [p for d in ("tests", "examples", "scripts", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    return sorted(set(modules().values()) | set(extra))


def test_layout_imports_each_name_from_its_defining_module_when_scanning_the_tree():
    mods = modules()
    names = {m: _top_level_names(ast.parse(p.read_text(), filename=str(p))) for m, p in mods.items()}
    bad = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in names):
                continue
            defined, only_imported = names[node.module]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                    if a.name in only_imported and f"{node.module}.{a.name}" not in mods]
    assert not bad, ("names imported through a module that only imports them; import them from the module that "
                     "defines them:\n" + "\n".join(bad))


def _contract_tag_names() -> dict[str, str]:
    """`tailguard.*` names core/contract.py defines (tags, tag prefixes, the model-file metadata key): value ->
    constant name."""
    tree = ast.parse((ROOT / "pipelines/core/contract.py").read_text())
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                and node.value.value.startswith("tailguard.")):
            out[node.value.value] = node.targets[0].id
    return out


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes of the module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def spelled_tag_names(source: str, names: dict[str, str]) -> list[tuple[int, str, str]]:
    """(line, literal, constant to use) for each string literal of `source` (docstrings aside; f-string parts
    included) that spells a contract name: equal to it, starting with a prefix name (ending in "."), or quoting it
    in an MLflow filter (tags.`<name>`)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
            continue
        for value, const in names.items():
            if (node.value == value or f"`{value}`" in node.value
                    or (value.endswith(".") and node.value.startswith(value))):
                out.append((node.lineno, node.value, const))
    return out


def test_layout_spells_tag_names_only_in_the_contract_when_scanning_every_module():
    names = _contract_tag_names()
    assert len(names) > 30, "read too few tag names from core/contract.py"
    bad = []
    for name, path in sorted(modules().items()):
        if name == "tailguard.core.contract":
            continue
        bad += [f"{path.relative_to(ROOT)}:{line}: {lit!r}: use tailguard.core.contract.{const}"
                for line, lit, const in spelled_tag_names(path.read_text(), names)]
    assert not bad, "tag names spelled outside tailguard.core.contract:\n" + "\n".join(bad)


def test_layout_spelled_tag_names_finds_literals_and_filters_when_given_synthetic_source():
    names = {"tailguard.variant": "VARIANT_TAG", "tailguard.label.": "LABEL_TAG_PREFIX"}
    src = ('"""Docstring naming tailguard.variant."""\n'
           'a = {"tailguard.variant": 1}\n'
           'b = f"tags.`tailguard.variant` = \'{x}\'"\n'
           'c = f"tailguard.label.{k}"\n'
           'd = "tailguard.variants_total"\n')
    assert [(line, const) for line, _, const in spelled_tag_names(src, names)] == [
        (2, "VARIANT_TAG"), (3, "VARIANT_TAG"), (4, "LABEL_TAG_PREFIX")]
