"""Vet a `.pt2` file (torch.export program or AOTInductor package) before torch loads it: such a file is code
unless proven otherwise.

Why: `torch.export.load` / `torch._inductor.aoti_load_package` (torch 2.13, `torch/export/pt2_archive/_package.py`,
`torch/_export/serde/serialize.py`, `torch/export/_unlift.py`) run code from the archive in these places:

- a weight or constant whose payload config says `use_pickle` (torch writes one for a tensor subclass,
  `_should_use_pickle`): `torch.load(weights_only=False)`, so any pickle runs;
- `data/constants/custom_obj_N` (a torchbind ScriptObject): `torch._C._pickle_load_obj`;
- `data/constants/opaque_obj_N` (an opaque Python value): `pickle.loads`;
- `data/weights/<model>.pt`, `data/constants/<model>.pt` (legacy), `data/sample_inputs/<model>.pt` and the pre-2.8
  format's `serialized_*.pt`: `torch.load(weights_only=True)`, and on failure `torch.load(weights_only=False)`;
- every `expr_str` of a symbolic size in `models/<model>.json`: `sympy.sympify(text)`, which `eval`s it;
- `guards_code` in `models/<model>.json`: pasted into Python source and `exec`ed by `.module()`, run on every call;
- `data/aotinductor/...` (an AOTInductor package): compiled `.so` files, `dlopen`ed: native code.

So before any load, `check_pt2_archive` reads the archive as a zip and accepts only what it can prove is data: the
exact entry names `torch.export.save` writes, payload configs whose every entry is a raw tensor storage
(`use_pickle: false`, a `weight_N` / `tensor_N` record with tensor metadata), sample inputs that load with
`torch.load(weights_only=True)` (so torch's first try succeeds and its `weights_only=False` fallback never runs),
symbolic expressions made only of sympy's arithmetic and torch's shape functions over symbols and numbers (no
attribute access, no call of anything else), and guard code made only of comparisons of input sizes. Anything
else, and any AOTInductor package, is refused unless the caller says the source is trusted
(`model.source.trusted: true` in the spec, `--trusted` on the CLI).

The zip is read the way torch's reader (`caffe2/serialize/inline_container.cc`, miniz) reads it: the first entry's
top folder is the archive root and every name is looked up under it, case-insensitively; an entry outside the root,
two names equal up to case, or an absolute / `..` name is refused (a parser difference between this check and
torch's reader would otherwise let one entry be checked and another loaded).

The file should not change between this check and the load (the callers check and load the same local file in one
process, after its manifest digest check where there is one).
"""

from __future__ import annotations

import ast
import io
import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from tailguard.core.errors import InputError, UntrustedModelError

SPEC_FIX = "set model.source.trusted: true in the spec (only for a file from a source you control)"
REGISTER_FIX = "pass --trusted to tailguard register (only for a file from a source you control)"
MONITOR_FIX = "pass --trusted to the monitor (only for a file from a source you control)"

PROGRAM = "torch.export program"
AOTI_PACKAGE = "AOTInductor package"

# What torch.export.save (torch 2.13) writes, relative to the archive root (torch/csrc/export/pt2_archive_constants.h).
_FIXED_ENTRIES = frozenset({"archive_format", "archive_version", "byteorder", ".data/version",
                            ".data/serialization_id"})
_MODEL_NAME = r"[A-Za-z0-9_.-]{1,128}"
_MODEL_RE = re.compile(rf"models/({_MODEL_NAME})\.json")
_WEIGHTS_CONFIG_RE = re.compile(rf"data/weights/({_MODEL_NAME})_weights_config\.json")
_CONSTANTS_CONFIG_RE = re.compile(rf"data/constants/({_MODEL_NAME})_constants_config\.json")
_WEIGHT_RE = re.compile(r"data/weights/weight_[0-9]{1,9}")
_TENSOR_RE = re.compile(r"data/constants/tensor_[0-9]{1,9}")
_SAMPLE_INPUTS_RE = re.compile(rf"data/sample_inputs/({_MODEL_NAME})\.pt")
_EXTRA_RE = re.compile(r"extra/[^/]{1,255}")
_AOTI_PREFIX = "data/aotinductor/"
MAX_EXPR_CHARS = 100_000
MAX_JSON_BYTES = 512 * 1024 * 1024

# sympy / torch names an `expr_str` may call (sympy.srepr of torch's shape expressions; the deserializer's
# `sympy_functions`, torch/_export/serde/serialize.py). Everything else reachable by name in sympify (builtins
# such as __import__, eval, open; sympy's sympify, lambdify, preview, var, ...) is refused.
_SYMPY_CALLS = frozenset({
    "Symbol", "Dummy", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs", "floor",
    "ceiling", "sqrt", "Piecewise", "ExprCondPair", "Equality", "Unequality", "StrictLessThan", "StrictGreaterThan",
    "LessThan", "GreaterThan", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Xor", "ITE",
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift",
    "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "BitwiseFn_bitwise_and",
    "BitwiseFn_bitwise_or", "BitwiseFn_bitwise_xor"})
_SYMPY_NAMES = frozenset({"oo", "zoo", "nan", "true", "false", "int_oo", "pi", "E", "True", "False", "None"})
_SYMBOL_NAME = re.compile(r"[a-z]{1,8}[0-9]{1,9}")  # torch's shape symbols: s0, s77, u3, zuf0, ...
_STRING_ARG = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}|[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
# guard code (torch/export/_unlift.py `_convert_guards_code_to_fn`): sizes of the inputs `L[...]` compared.
_GUARD_ATTRS = frozenset({"size", "stride", "storage_offset", "dim", "numel", "shape"})
_GUARD_MODULE_FUNCS = {"math": frozenset({"floor", "ceil", "trunc", "sqrt"}),
                       "torch": frozenset({"sym_max", "sym_min", "sym_int", "sym_float", "sym_not", "sym_ite"})}
_ARITH = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd, ast.Not,
          ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Load)


@dataclass
class Pt2Facts:
    """What `check_pt2_archive` found.

    Attributes:
        kind: PROGRAM or AOTI_PACKAGE.
        checked: False when the source was trusted and nothing was read.
        entries: archive entry names relative to the root (empty when not checked).
    """

    kind: str
    checked: bool
    entries: list[str] = field(default_factory=list)


class _Refusal(Exception):
    def __init__(self, entry: str, why: str) -> None:
        super().__init__(f"{entry}: {why}")
        self.entry, self.why = entry, why


def check_pt2_archive(path: str | Path, *, trusted: bool = False, fix: str = SPEC_FIX) -> Pt2Facts:
    """Refuse a `.pt2` whose loading would run code, unless its source is trusted (module docstring).

    Args:
        path: the `.pt2` file (torch.export.save, or torch._inductor.aoti_compile_and_package).
        trusted: the source is trusted (`model.source.trusted: true`, `--trusted`): nothing is read.
        fix: how the user marks the source trusted, for the error's hint (SPEC_FIX, MONITOR_FIX, ...).

    Returns:
        Pt2Facts (kind, whether it was checked, the entries).

    Raises:
        UntrustedModelError: (exit 2) the archive holds a pickled weight or constant, a custom or opaque object,
            pickled legacy / sample-input entries, an expression or guard that is code, an unknown entry, or native
            code (an AOTInductor package); the message names the file, the entry and why, the hint the fix.
        InputError: (exit 2) the file is missing or not a zip archive.
    """
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: file not found")
    if trusted:
        return Pt2Facts(kind=PROGRAM, checked=False)
    try:
        zf = zipfile.ZipFile(p)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise InputError(f"{p}: not a .pt2 archive (torch.export.save writes a zip): {exc}",
                         hint="save it with torch.export.save(torch.export.export(model.eval(), args), path)"
                         ) from None
    with zf:
        try:
            names = _relative_names(zf)
            if any(n.startswith(_AOTI_PREFIX) for n in names):
                raise UntrustedModelError(
                    f"{p}: an {AOTI_PACKAGE} (it holds compiled native code, "
                    f"{next(n for n in names if n.startswith(_AOTI_PREFIX))}, that loading runs); it loads only "
                    "from a trusted source", hint=fix)
            _check_entries(zf, names)
        except _Refusal as r:
            raise UntrustedModelError(
                f"{p}: entry {r.entry} {r.why}; loading it would run code from the file, so it loads only from a "
                "source marked trusted",
                hint=f"{fix}, or re-save the program with torch.export.save from a model whose weights and "
                     "constants are plain torch.Tensor (no tensor subclass, custom or opaque object)") from None
    return Pt2Facts(kind=PROGRAM, checked=True, entries=sorted(names))


def is_aoti_package(path: str | Path) -> bool:
    """Whether the zip at `path` holds an AOTInductor package (`data/aotinductor/...`); False for a non-zip."""
    try:
        with zipfile.ZipFile(path) as zf:
            return any(n.split("/", 1)[-1].startswith(_AOTI_PREFIX) for n in zf.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return False


# ------------------------------------------------------------------------------------------------ the zip
def _relative_names(zf: zipfile.ZipFile) -> dict[str, str]:
    """{name under the root: full name}, refusing what torch's reader would read differently."""
    infos = zf.infolist()
    if not infos:
        raise _Refusal("(none)", "is missing: the archive is empty")
    root = infos[0].filename.split("/", 1)[0]
    out: dict[str, str] = {}
    seen: set[str] = set()
    for info in infos:
        full = info.filename
        folded = full.casefold()
        if folded in seen:
            raise _Refusal(full, "appears twice (names equal up to case): torch's reader and this check could read "
                                 "different ones")
        seen.add(folded)
        if full.startswith(("/", "\\")) or "\\" in full or any(part in ("", ".", "..") for part in
                                                                full.rstrip("/").split("/")):
            raise _Refusal(full, "has an absolute, empty or '..' path component")
        if not full.startswith(root + "/"):
            raise _Refusal(full, f"lies outside the archive root {root!r}")
        rel = full[len(root) + 1:]
        if info.is_dir():
            continue
        out[rel] = full
    return out


def _check_entries(zf: zipfile.ZipFile, names: dict[str, str]) -> None:
    """Every entry is one torch.export.save writes, and each is data (module docstring)."""
    if "archive_format" not in names:
        what = ("an older torch.export archive (before torch 2.8) whose weights, constants and example inputs are "
                "pickled" if any(n.startswith("serialized_") or n == "version" for n in names) else
                "not a torch.export archive (no archive_format entry)")
        raise _Refusal("archive_format", f"is missing: {what}")
    models = {m.group(1) for n in names if (m := _MODEL_RE.fullmatch(n))}
    if not models:
        raise _Refusal("models/", "is missing: the archive holds no program")
    for rel in names:
        if rel in _FIXED_ENTRIES or _WEIGHT_RE.fullmatch(rel) or _TENSOR_RE.fullmatch(rel) or _EXTRA_RE.fullmatch(rel):
            continue
        for regex in (_MODEL_RE, _WEIGHTS_CONFIG_RE, _CONSTANTS_CONFIG_RE, _SAMPLE_INPUTS_RE):
            m = regex.fullmatch(rel)
            if m and m.group(1) in models:
                break
        else:
            raise _Refusal(rel, _unknown_why(rel))
    for model in sorted(models):
        _check_payload_config(zf, names, f"data/weights/{model}_weights_config.json", "weight", "data/weights/")
        _check_payload_config(zf, names, f"data/constants/{model}_constants_config.json", "tensor",
                              "data/constants/")
        _check_program(zf, names, f"models/{model}.json")
        sample = f"data/sample_inputs/{model}.pt"
        if sample in names:
            _check_sample_inputs(zf, names, sample)


def _unknown_why(rel: str) -> str:
    if rel.startswith("data/constants/custom_obj_"):
        return "is a torchbind custom object (loaded with torch's TorchScript unpickler)"
    if rel.startswith("data/constants/opaque_obj_"):
        return "is an opaque Python object (loaded with pickle.loads)"
    if rel.startswith(("data/weights/", "data/constants/")) and rel.endswith(".pt"):
        return "is a legacy pickled weights / constants file (torch.load falls back to weights_only=False)"
    return "is not an entry torch.export.save writes (only its known data entries are accepted)"


def _read_json(zf: zipfile.ZipFile, names: dict[str, str], rel: str) -> Any:
    info = zf.getinfo(names[rel])
    if info.file_size > MAX_JSON_BYTES:
        raise _Refusal(rel, f"is {info.file_size} bytes, over the {MAX_JSON_BYTES} bytes this check reads")
    try:
        return json.loads(zf.read(names[rel]))
    except (ValueError, RecursionError) as exc:
        raise _Refusal(rel, f"is not valid JSON ({type(exc).__name__})") from None


def _check_payload_config(zf: zipfile.ZipFile, names: dict[str, str], rel: str, prefix: str, folder: str) -> None:
    """Every weight / constant is a raw tensor storage record: `use_pickle` false, a `<prefix>_N` record that
    exists, tensor metadata present."""
    if rel not in names:
        raise _Refusal(rel, "is missing (torch.export.save always writes it)")
    config = _read_json(zf, names, rel)
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise _Refusal(rel, "has no 'config' mapping")
    for fqn, meta in entries.items():
        if not isinstance(meta, dict):
            raise _Refusal(rel, f"entry {fqn!r} is not a mapping")
        path_name = meta.get("path_name")
        where = f"{rel} ({fqn!r} -> {path_name!r})"
        if meta.get("use_pickle") is not False:
            kind = "weight" if prefix == "weight" else "constant"
            raise _Refusal(where, f"is a pickled {kind} (use_pickle: torch.load(weights_only=False) runs any pickle; "
                                  "torch writes one for a tensor subclass or a custom object)")
        if not isinstance(path_name, str) or not re.fullmatch(rf"{prefix}_[0-9]{{1,9}}", path_name):
            raise _Refusal(where, f"does not name a raw {prefix}_N tensor record")
        if folder + path_name not in names:
            raise _Refusal(where, "names a record the archive does not hold")
        if not isinstance(meta.get("tensor_meta"), dict):
            raise _Refusal(where, "has no tensor metadata")


def _walk_expr_strings(node: Any, depth: int = 0) -> Iterator[str]:
    """Every `expr_str` value in a JSON tree (the symbolic sizes torch sympifies)."""
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            for k, v in cur.items():
                if k == "expr_str":
                    yield v if isinstance(v, str) else repr(v)
                elif isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(cur, list):
            stack.extend(x for x in cur if isinstance(x, (dict, list)))


def _check_program(zf: zipfile.ZipFile, names: dict[str, str], rel: str) -> None:
    program = _read_json(zf, names, rel)
    if not isinstance(program, dict):
        raise _Refusal(rel, "is not a serialized ExportedProgram")
    for text in _walk_expr_strings(program):
        why = _expr_problem(text, guard=False)
        if why:
            raise _Refusal(rel, f"holds a symbolic size expression torch would eval (sympy.sympify) that is not "
                                f"plain arithmetic: {text[:200]!r} ({why})")
    guards = program.get("guards_code") or []
    if not isinstance(guards, list):
        raise _Refusal(rel, "has a guards_code that is not a list")
    for text in guards:
        why = _expr_problem(text, guard=True) if isinstance(text, str) else "not a string"
        if why:
            raise _Refusal(rel, f"holds guard code torch would exec on every call that is not a comparison of input "
                                f"sizes: {str(text)[:200]!r} ({why})")


def _check_sample_inputs(zf: zipfile.ZipFile, names: dict[str, str], rel: str) -> None:
    """The example inputs load with `torch.load(weights_only=True)` (no code runs: torch's restricted unpickler)."""
    import torch

    try:
        torch.load(io.BytesIO(zf.read(names[rel])), weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ... for what it refuses
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise _Refusal(rel, f"does not load with torch.load(weights_only=True), so torch would unpickle it with "
                            f"weights_only=False ({type(exc).__name__}: {first})") from None


# ----------------------------------------------------------------------------------------- expressions
def _expr_problem(text: str, *, guard: bool) -> str | None:
    """None when `text` is plain arithmetic over shape symbols (sympy expression) or input sizes (guard), else
    why not."""
    if len(text) > MAX_EXPR_CHARS:
        return f"{len(text)} characters, over {MAX_EXPR_CHARS}"
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        return f"not an expression: {type(exc).__name__}"
    try:
        for node in ast.walk(tree):
            why = _guard_node(node) if guard else _sympy_node(node)
            if why:
                return why
    except RecursionError:
        return "nested too deeply"
    return None


def _common_node(node: ast.AST) -> str | None | bool:
    """True: allowed here; a str: refused with it; None: not decided (the caller decides)."""
    if isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.keyword)
                  ) or isinstance(node, _ARITH):
        if isinstance(node, ast.keyword) and not (node.arg and isinstance(node.value, ast.Constant)
                                                  and isinstance(node.value.value, (bool, int))):
            return "a keyword argument that is not a bool or int"
        return True
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (bool, int, float)):
            return True
        if isinstance(v, str) and _STRING_ARG.fullmatch(v):
            return True
        return f"the constant {str(v)[:60]!r}"
    return None


def _sympy_node(node: ast.AST) -> str | None:
    verdict = _common_node(node)
    if verdict is True:
        return None
    if isinstance(verdict, str):
        return verdict
    if isinstance(node, ast.Call):
        if not (isinstance(node.func, ast.Name) and node.func.id in _SYMPY_CALLS):
            return f"a call of {ast.unparse(node.func)[:60]!r}, not a sympy / torch shape function"
        return None
    if isinstance(node, ast.Name):
        if node.id in _SYMPY_CALLS or node.id in _SYMPY_NAMES or _SYMBOL_NAME.fullmatch(node.id):
            return None
        return f"the name {node.id!r}"
    return f"a {type(node).__name__} node"


def _guard_node(node: ast.AST) -> str | None:
    verdict = _common_node(node)
    if verdict is True:
        return None
    if isinstance(verdict, str):
        return verdict
    if isinstance(node, ast.Name):
        return None if node.id in ("L", "args", *_GUARD_MODULE_FUNCS) else f"the name {node.id!r}"
    if isinstance(node, ast.Subscript):
        sl = node.slice
        if isinstance(sl, ast.Constant) and isinstance(sl.value, (int, str)):
            return None
        return "a subscript that is not a constant"
    if isinstance(node, ast.Attribute):
        if node.attr in _GUARD_ATTRS:
            return None
        if isinstance(node.value, ast.Name) and node.attr in _GUARD_MODULE_FUNCS.get(node.value.id, ()):
            return None
        return f"the attribute {node.attr!r}"
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and (func.attr in _GUARD_ATTRS or (
                isinstance(func.value, ast.Name) and func.attr in _GUARD_MODULE_FUNCS.get(func.value.id, ()))):
            return None
        if isinstance(func, ast.Name) and func.id in _SYMPY_CALLS:
            return None
        return f"a call of {ast.unparse(func)[:60]!r}"
    return f"a {type(node).__name__} node"
