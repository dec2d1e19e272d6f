"""The declared model outputs (`model.outputs`: name, dtype, shape) checked against what the model really returns.

A spec that declares `logits: [batch, 16]` for a 15-class model used to pass `spec check` and a whole run. These
functions compare each declared output with a model's *signature* (the ONNX graph's outputs, a torch.export
program's output values) and with arrays the model returned on a batch, and report every mismatch at once as a
`SpecError` (exit 2) naming the output, what was declared, what was found, and the declaration that fits.

Rules (docs/spec.md, "Outputs"):

- dtype: the declared dtype must equal the model's.
- rank: the number of axes must be equal.
- axes: a named axis (`batch`, `sequence`) matches any size; a fixed size (an int) must equal the model's size. A
  signature axis that is itself symbolic (an ONNX `dim_param`, a torch SymInt) cannot be compared with a fixed
  size: the check on real outputs (`output_array_errors`) decides it.
- a declared output the model lacks is an error; an output the model has and the spec does not declare is fine
  for a model whose outputs are named (ONNX): tailguard compares only the declared ones. A torch model's outputs
  are positional (forward() returns a tuple), so there every output must be declared, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from tailguard.core.errors import FieldError, SpecError

# The dtypes a spec can declare (TensorSpec.dtype).
SPEC_DTYPES = ("int64", "int32", "float32", "float16", "bool")


@dataclass(frozen=True)
class OutputSig:
    """One output as a model describes it.

    Attributes:
        name: the output's name (ONNX) or its position as "#<i>" (a torch program's outputs have no names).
        dtype: numpy dtype name ("float32", "int64", "float64", "bool", ...), or None when unknown.
        shape: one entry per axis: an int (fixed size), a str (a symbolic axis, e.g. "batch_size", "s77"), or None
            (unknown); None for the whole shape when the rank is unknown.
    """

    name: str
    dtype: str | None
    shape: tuple[int | str | None, ...] | None

    def to_dict(self) -> dict[str, Any]:
        """JSON form: {"name", "dtype", "shape"}."""
        return {"name": self.name, "dtype": self.dtype, "shape": None if self.shape is None else list(self.shape)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "OutputSig":
        """Inverse of `to_dict`."""
        shape = d.get("shape")
        return cls(str(d["name"]), d.get("dtype"), None if shape is None else tuple(shape))


# ------------------------------------------------------------------------------------------- signatures
def onnx_output_signature(model: Any) -> list[OutputSig]:
    """The graph outputs of an ONNX model: name, element type and shape (dim_value / dim_param).

    Args:
        model: an `onnx.ModelProto`, or the path of an .onnx file (read without its external data).

    Returns:
        One OutputSig per graph output, in graph order.
    """
    import onnx

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    out = []
    for o in proto.graph.output:
        tt = o.type.tensor_type
        dtype = _onnx_dtype(tt.elem_type) if tt.elem_type else None
        shape: tuple[int | str | None, ...] | None = None
        if tt.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        out.append(OutputSig(o.name, dtype, shape))
    return out


def exported_program_output_signature(ep: Any) -> list[OutputSig]:
    """The user outputs of a `torch.export.ExportedProgram`, positional ("#0", "#1", ...), from the traced values
    (`node.meta["val"]`: a FakeTensor whose dynamic axes are SymInts, reported as their symbol, e.g. "s77").

    Returns:
        One OutputSig per user output (buffer mutations left out); dtype/shape None where the trace has no value.
    """
    from torch.export.graph_signature import OutputKind

    node = next(n for n in ep.graph.nodes if n.op == "output")
    values = list(node.args[0]) if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    kinds = [s.kind for s in ep.graph_signature.output_specs]
    user = [v for v, k in zip(values, kinds) if k == OutputKind.USER_OUTPUT] if len(kinds) == len(values) else values
    out = []
    for i, v in enumerate(user):
        val = getattr(v, "meta", {}).get("val") if hasattr(v, "meta") else None
        if val is None or not hasattr(val, "shape"):
            out.append(OutputSig(f"#{i}", None, None))
            continue
        shape = tuple(int(d) if isinstance(d, int) else str(d) for d in val.shape)
        out.append(OutputSig(f"#{i}", str(val.dtype).removeprefix("torch."), shape))
    return out


def array_output_signature(names: Sequence[str], arrays: Sequence[Any]) -> list[OutputSig]:
    """OutputSigs of arrays a model returned (concrete shapes), named by `names` (extra arrays get "#<i>")."""
    import numpy as np

    out = []
    for i, a in enumerate(arrays):
        if hasattr(a, "detach"):  # a torch tensor
            a = a.detach().cpu().numpy()
        a = np.asarray(a)
        out.append(OutputSig(names[i] if i < len(names) else f"#{i}", a.dtype.name, tuple(int(d) for d in a.shape)))
    return out


def _onnx_dtype(elem_type: int) -> str | None:
    import numpy as np
    import onnx

    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name
    except (KeyError, TypeError, ValueError):
        return onnx.TensorProto.DataType.Name(elem_type).lower()


# ------------------------------------------------------------------------------------------------ checks
def _text(shape: Sequence[Any] | None) -> str:
    if shape is None:
        return "an unknown shape"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _fitting_shape(declared: Sequence[str | int], found: Sequence[int | str | None]) -> list[str | int]:
    """The declaration that fits `found`: declared axis names kept where the rank allows, the model's fixed sizes
    elsewhere, its symbolic axes under their own (valid) names."""
    import re

    out: list[str | int] = []
    for i, d in enumerate(found):
        named = declared[i] if i < len(declared) and isinstance(declared[i], str) else None
        if i == 0:
            out.append(named or (declared[0] if declared and isinstance(declared[0], str) else "batch"))
        elif isinstance(d, int) and d > 0:
            out.append(d)
        elif named:
            out.append(named)
        else:
            out.append(d if isinstance(d, str) and re.fullmatch(r"[A-Za-z_]\w*", d) else f"dim{i}")
    return out


def output_signature_errors(declared: Sequence[Any], found: Sequence[OutputSig], *, what: str,
                            positional: bool = False, concrete: bool = False,
                            model_task: str | None = None) -> tuple[list[FieldError], list[str]]:
    """Each declared output against the model's signature: presence, dtype, rank, fixed sizes.

    Args:
        declared: `model.outputs` (TensorSpec: name, dtype, shape).
        found: the model's outputs (`onnx_output_signature`, `exported_program_output_signature`,
            `array_output_signature`).
        what: who reports them, for the messages ("the ONNX graph", "the model's output on a batch of 2 rows").
        positional: match by position (torch outputs), not by name; then an output count that differs is an
            error too.
        concrete: `found` shapes are real sizes (outputs of a run): a fixed declared size is compared with them;
            otherwise a symbolic signature axis matches a fixed declared size (the run decides).
        model_task: model.task, or None: a compared output (the first) that the model gives with 3 axes while the task
            is classification gets the fix "use task: token_classification" (issue 38: a CTC recognizer's
            (batch, time, classes) scores were accepted under classification and failed mid-run).

    Returns:
        (one FieldError per problem, at `model.outputs.<i>.dtype` / `.shape` / `.name`; the fixes, e.g.
        "declare logits: [batch, 15]").
    """
    errors: list[FieldError] = []
    fixes: list[str] = []
    by_name = {s.name: s for s in found}
    if positional and len(found) != len(declared):
        errors.append(FieldError("model.outputs", f"{what} returns {len(found)} output(s) but model.outputs declares "
                                 f"{len(declared)} ({[t.name for t in declared]}); a torch model's outputs are "
                                 "positional, so every forward() output is declared, in order"))
        fixes.append("list every forward() output in model.outputs, in order")
    for i, t in enumerate(declared):
        sig = (found[i] if i < len(found) else None) if positional else by_name.get(t.name)
        if sig is None:
            if not positional:
                errors.append(FieldError(f"model.outputs.{i}.name", f"{t.name!r} is declared but {what} has no "
                                         f"output of that name (outputs: {[s.name for s in found]})", t.name))
                fixes.append(f"name the outputs as the model does ({', '.join(s.name for s in found)}) or "
                             "remove the ones it lacks")
            continue
        if sig.dtype is not None and sig.dtype != t.dtype:
            hint = (f"declare {t.name} dtype: {sig.dtype}" if sig.dtype in SPEC_DTYPES else
                    f"cast {t.name} to one of {list(SPEC_DTYPES)} in the model ({sig.dtype} cannot be declared)")
            errors.append(FieldError(f"model.outputs.{i}.dtype", f"{t.name} is declared {t.dtype} but {what} gives "
                                     f"{sig.dtype}", t.dtype))
            fixes.append(hint)
        if sig.shape is None:
            continue
        bad = len(sig.shape) != len(t.shape)
        if not bad:
            for want, got in zip(t.shape, sig.shape):
                if isinstance(want, int) and (isinstance(got, int) or concrete) and got != want:
                    bad = True
        if bad:
            fit = _fitting_shape(list(t.shape), list(sig.shape))
            errors.append(FieldError(f"model.outputs.{i}.shape", f"{t.name} is declared {_text(t.shape)} but {what} "
                                     f"gives {_text(sig.shape)}", list(t.shape)))
            token = i == 0 and model_task == "classification" and len(sig.shape) == 3
            fixes.append(f"declare {t.name}: {_text(fit)}" + (" and use task: token_classification (a (batch, "
                                                              "time, classes) output)" if token else ""))
    return errors, fixes


def check_output_signature(declared: Sequence[Any], found: Sequence[OutputSig], *, what: str, source: str,
                           positional: bool = False, concrete: bool = False, model_task: str | None = None) -> None:
    """`output_signature_errors`, raised.

    Raises:
        SpecError: every mismatch (exit 2), source `source` (e.g. the spec file or "export"), the fixes as hint.
    """
    errors, fixes = output_signature_errors(declared, found, what=what, positional=positional, concrete=concrete,
                                            model_task=model_task)
    if errors:
        raise SpecError(errors, source=source, hint="; ".join(dict.fromkeys(fixes)))
