"""Load a torch module from its files: a torch.export program (.pt2), or a state dict into an importable
`nn.Module` class found on the model search path.

Shared by the reference's resolve (tailguard.core.reference `load_torch_reference`) and by registration
(tailguard.registration, which checks files before it registers them). A state dict's `class_path` module is
imported from `sys.path`, then from the folders of $TAILGUARD_MODEL_PATH (`add_model_path`; the local runner sets it
to the spec's folder and `--model-path`). Trust: a .pt2 loads only after its archive was read and holds no code
(tailguard.core.pt2_archive), unless the caller says the source is trusted; a state dict is read with
`weights_only` / safetensors, so no code in it runs.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from tailguard.core.errors import InputError
from tailguard.core.pt2_archive import SPEC_FIX, check_pt2_archive

if TYPE_CHECKING:  # torch is imported inside the functions (KFP components import this module)
    import torch

# Folders (os.pathsep-separated) searched for the module of a state dict's class_path after the installed packages.
# The local runner sets it for its tasks (the spec's folder and `tailguard run --model-path`); a cluster image
# installs the package that defines the class instead.
MODEL_PATH_ENV = "TAILGUARD_MODEL_PATH"
_MAX_LISTED = 20


def load_exported_program(path: Path, *, field: str, trusted: bool = False, fix: str = SPEC_FIX) -> Any:
    """`torch.export.load(path)`, with a missing or unreadable file as an InputError naming `field`, after
    `check_pt2_archive` (a .pt2 is code unless proven otherwise; tailguard.core.pt2_archive).

    Args:
        path: the .pt2 file.
        field: the spec / CLI field that named it, for messages.
        trusted: load without reading the archive for code first (a source the user trusts).
        fix: how the user marks the source trusted, for a refusal's hint.

    Returns:
        The torch.export.ExportedProgram.

    Raises:
        InputError: a missing or unreadable file (exit 2).
        UntrustedModelError: (exit 2) not `trusted` and loading the archive would run code from it.
    """
    import torch

    if not path.is_file():
        raise InputError(f"{field}: file not found: {path}")
    check_pt2_archive(path, trusted=trusted, fix=fix)
    try:
        ep = torch.export.load(str(path))
    except Exception as exc:  # torch raises several types for a bad archive
        raise InputError(f"{field}: {path} is not a torch.export program (torch.export.save / .pt2): "
                         f"{type(exc).__name__}: {exc}",
                         hint="save it with torch.export.save(torch.export.export(model.eval(), args), path)"
                         ) from None
    if not isinstance(ep, torch.export.ExportedProgram):
        raise InputError(f"{field}: {path} does not hold a torch.export.ExportedProgram")
    return ep


def _short(keys: list[str], n: int = 20) -> str:
    return str(list(keys[:n])) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def read_state_dict(path: Path, field_name: str) -> dict[str, Any]:
    """Read {parameter name: tensor} from a .safetensors file, or a torch.save file with `weights_only=True` (no
    code runs: a pickled whole module is refused).

    Returns:
        {name: tensor} on the CPU.

    Raises:
        InputError: the file is missing, unreadable, a pickled module, or not a flat {name: tensor} mapping
            (names `field_name`).
    """
    import torch

    if not path.is_file():
        raise InputError(f"{field_name}: state dict file not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path), device="cpu")
        else:
            sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors / torch.load (weights_only refusal) raise various types
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
        first = ("it holds pickled Python objects (e.g. a whole module saved with torch.save(model)), which are "
                 "not unpickled" if "Weights only load failed" in text else
                 (text.splitlines() or [type(exc).__name__])[0])
        raise InputError(f"{field_name}: {path} is not a plain state dict (safetensors, or torch.save of tensors "
                         f"loadable with weights_only=True): {first}",
                         hint="save the weights with torch.save(model.state_dict(), path) or "
                              "safetensors.torch.save_file; a pickled whole module is not loaded") from None
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        nested = [k for k, v in sd.items() if isinstance(v, Mapping)] if isinstance(sd, Mapping) else []
        raise InputError(f"{field_name}: {path} does not hold a {{name: tensor}} state dict",
                         hint=(f"it looks like a checkpoint; save its {nested[0]!r} entry alone" if nested else
                               "save model.state_dict()"))
    return dict(sd)


def model_search_path(extra: Iterable[str | Path] = ()) -> list[Path]:
    """Folders searched for a model class's module after the installed packages: `extra`, then $TAILGUARD_MODEL_PATH.

    Args:
        extra: folders given by the caller (e.g. `tailguard register --model-path`), searched first.

    Returns:
        Absolute folders, in search order, without duplicates (missing folders are kept: the caller reports them).
    """
    entries = [*extra, *(e for e in os.environ.get(MODEL_PATH_ENV, "").split(os.pathsep) if e)]
    out: list[Path] = []
    for e in entries:
        p = Path(e).expanduser().resolve()
        if p not in out:
            out.append(p)
    return out


def add_model_path(extra: Iterable[str | Path] = ()) -> list[Path]:
    """Append the folders of `model_search_path(extra)` to `sys.path` (after the installed packages).

    Appending, not prepending: a module in the user's folder never shadows an installed or standard-library module
    (a `types.py` beside the spec must not break `import types`); a module that exists only there is found.

    Returns:
        The folders searched (`model_search_path(extra)`).
    """
    folders = model_search_path(extra)
    added = False
    for folder in folders:
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
            added = True
    if added:
        importlib.invalidate_caches()
    return folders


def import_module_class(class_path: str, *, field: str = "model.source.class_path",
                        search_path: Iterable[str | Path] = ()) -> type:
    """Import "package.module:Class" and check that it is a torch.nn.Module subclass.

    The module is looked up on `sys.path` (installed packages, and the current directory where Python puts it
    there), then in `search_path` and the folders of $TAILGUARD_MODEL_PATH (see `add_model_path`).

    Args:
        class_path: "package.module:Class".
        field: the spec field or argument named in errors.
        search_path: extra folders to search for the module.

    Raises:
        InputError: malformed path, module not importable (the folders searched are listed), no such class, or not
            an nn.Module (names `field`).
    """
    import torch

    mod_name, sep, cls_name = class_path.partition(":")
    if not sep or not mod_name or not cls_name:
        raise InputError(f"{field}: {class_path!r} is not 'package.module:Class'")
    folders = add_model_path(search_path)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        searched = ", ".join(str(f) for f in folders) or "none"
        raise InputError(f"{field}: cannot import module {mod_name!r} of {class_path!r}: {exc} (installed packages "
                         f"and the current directory searched, then the model path: {searched})",
                         hint="put the module beside the spec file or pass --model-path DIR (tailguard run / "
                              "register), or install the package that defines the class (on a cluster: in the "
                              "step's image)") from None
    except Exception as exc:  # the module was found but running it failed (SyntaxError, NameError, ...)
        raise InputError(f"{field}: importing module {mod_name!r} of {class_path!r} failed: "
                         f"{type(exc).__name__}: {exc}", hint="fix the module so that `import` runs") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        known = [n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, torch.nn.Module)]
        close = difflib.get_close_matches(cls_name, known, n=3)
        raise InputError(f"{field}: module {mod_name!r} has no class {cls_name!r}",
                         hint=f"did you mean {close}?" if close else f"nn.Module classes there: {known[:_MAX_LISTED]}")
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise InputError(f"{field}: {class_path!r} is not a torch.nn.Module subclass")
    return cls


def build_state_dict_module(class_path: str, init_kwargs: Mapping[str, Any], weights: Mapping[str, Any], *,
                            weights_name: str, class_field: str = "model.source.class_path",
                            kwargs_field: str = "model.source.init_kwargs",
                            search_path: Iterable[str | Path] = ()) -> "torch.nn.Module":
    """Import `class_path`, build it with `init_kwargs` and load `weights` strictly (every bad key listed).

    Args:
        class_path: "package.module:Class" of a torch.nn.Module.
        init_kwargs: keyword arguments of the class.
        weights: {parameter name: tensor}.
        weights_name: the weights' file name, for messages.
        class_field / kwargs_field: the spec fields or arguments named in errors.
        search_path: extra folders for the class's module (see `import_module_class`).

    Returns:
        The module in eval mode.

    Raises:
        InputError: the class cannot be imported, `cls(**init_kwargs)` fails (names `kwargs_field`), or the weights
            do not fit (missing / unexpected keys or shape mismatches; names `class_field`).
    """
    cls = import_module_class(class_path, field=class_field, search_path=search_path)
    init_kwargs = dict(init_kwargs)
    try:
        module = cls(**init_kwargs)
    except TypeError as exc:
        raise InputError(f"{kwargs_field}: {class_path}(**{init_kwargs}) failed: {exc}",
                         hint=f"fix {kwargs_field} to match the class's __init__") from None
    try:
        result = module.load_state_dict(dict(weights), strict=False)
    except RuntimeError as exc:  # shape mismatches raise even with strict=False
        raise InputError(f"{class_field}: the state dict {weights_name} does not fit {class_path}: {exc}",
                         hint=f"check {class_field} and {kwargs_field} (layer sizes) against the weights") from None
    if result.missing_keys or result.unexpected_keys:
        raise InputError(
            f"{class_field}: the state dict {weights_name} does not fit {class_path}: "
            f"missing keys {_short(result.missing_keys)}, unexpected keys {_short(result.unexpected_keys)}",
            hint=f"check {class_field} and {kwargs_field} against the weights")
    return module.eval()
