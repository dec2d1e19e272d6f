"""The spec's `model` section: the FP32 reference in the MLflow registry (`ModelSpec`), its inputs and outputs
(`TensorSpec`), how it is stored (`ModelSource`), exported to ONNX (`ExportSpec`) and, for token_classification,
decoded (`DecodeSpec`); `ModelTask`, the model's ML task (the field `model.task`) that decides the parity metrics
(`tailguard.core.spec.gates.MODEL_TASK_METRICS`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tailguard.core.spec.base import SpecModel

ModelTask = Literal["classification", "embedding", "regression", "generic", "token_classification"]

_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class TensorSpec(SpecModel):
    """One model input or output."""

    name: str = Field(description="Tensor name in the ONNX graph / the torch forward() argument name.")
    dtype: Literal["int64", "int32", "float32", "float16", "bool"] = Field(description="Element type.")
    shape: list[str | int] = Field(min_length=1, description=(
        "Axes, batch first: a name is a dynamic axis (e.g. batch, sequence), a positive int a fixed size, "
        "e.g. [batch, sequence] for token ids, [batch, 1, 8, 8] for images, [batch, sequence, 80] for audio "
        "frames. The first axis must be a name (tailguard runs several batch sizes). For inputs, every named "
        "axis after batch is a variable length padded per batch (model.pad_values); every int axis must match "
        "in every data row."))
    value_range: tuple[float, float] | None = Field(None, description=(
        "Inputs only: inclusive [min, max] of every element, e.g. [0, 30521] for token ids of a 30522-word "
        "vocabulary. The data check fails rows with an element outside it."))
    kind: Literal["logits", "probabilities"] | None = Field(None, description=(
        "Outputs only, classification: what the compared output holds: 'logits' (default; KL divergence and "
        "margins on its softmax) or 'probabilities' (rows already sum to 1, e.g. a model ending in Softmax: KL on "
        "the values themselves). Validation warns when logits rows already sum to 1. Also accepted for "
        "token_classification, where only each position's top-1 class is compared, so it changes nothing."))

    @field_validator("shape", mode="before")
    @classmethod
    def _shape_dims(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v  # pydantic reports the type error
        problems = []
        for i, d in enumerate(v):
            if isinstance(d, bool) or not isinstance(d, (int, str)):
                problems.append(f"axis {i} is {d!r}: give a positive int (fixed size) or a name (dynamic axis)")
            elif isinstance(d, int) and d < 1:
                problems.append(f"axis {i} is {d}: a fixed size must be a positive int")
            elif isinstance(d, str) and not _AXIS_NAME.fullmatch(d):
                problems.append(f"axis {i} is {d!r}: a dynamic axis name is letters, digits, '_' (e.g. "
                                f"'sequence'), not starting with a digit")
        if v and not problems and not isinstance(v[0], str):
            dims = [str(d) for d in v]
            problems.append(f"axis 0 is {v[0]!r}: the first axis is the batch axis and must be a name "
                            f"(tailguard runs several batch sizes): [{', '.join(['batch', *dims[1:]])}] if "
                            f"{v[0]!r} is a fixed batch size, [{', '.join(['batch', *dims])}] if the batch axis "
                            "is missing")
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @model_validator(mode="after")
    def _range_order(self) -> "TensorSpec":
        if self.value_range is not None and self.value_range[0] > self.value_range[1]:
            raise ValueError("value_range must be [min, max] with min <= max")
        return self


class ExportTolerance(SpecModel):
    """Allowed difference between the torch model and its ONNX export for one output: |a-b| <= atol + rtol*|b|."""

    atol: float = Field(1e-4, ge=0, description="Absolute tolerance.")
    rtol: float = Field(1e-3, ge=0, description="Relative tolerance.")


class ExportSpec(SpecModel):
    """torch -> ONNX export settings (ignored when the reference is already ONNX)."""

    opset: int = Field(17, ge=13, le=23, description="ONNX opset version.")
    dynamo: bool = Field(False, description=(
        "Use torch.export-based exporter (torch.onnx.export(dynamo=True)). The legacy TorchScript exporter "
        "(False) produces graphs that ONNX Runtime's transformer fusions recognise."))
    check_samples: int = Field(8, ge=1, description="Validation rows used to compare ONNX and torch outputs.")
    tolerances: dict[str, ExportTolerance] = Field(
        default_factory=dict, description="Per-output tolerance by output name; missing outputs use `default`.")
    default: ExportTolerance = Field(default_factory=ExportTolerance,
                                     description="Tolerance for outputs not named in `tolerances`.")


class ModelSource(SpecModel):
    """How the FP32 reference is stored in the registry version, and how far it may be trusted."""

    format: Literal["auto", "onnx", "torch_export", "state_dict", "pickle"] = Field(
        "auto", description=("auto: read the MLmodel flavor (onnx, pytorch exported program, pytorch pickle) or "
                             "find a state dict; state_dict needs class_path."))
    class_path: str | None = Field(None, description=(
        "'module:Class' of a torch.nn.Module built with init_kwargs, into which a state dict is loaded with "
        "torch.load(weights_only=True) or safetensors."), pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    init_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for class_path.")
    weights_file: str | None = Field(None, description=(
        "State-dict file inside the registry version's artifacts (default: the single *.safetensors/*.pt file)."))
    trusted: bool = Field(False, description=(
        "Allow a pickled PyTorch model (mlflow.pytorch default flavor), and a .pt2 (the reference, a registered torch "
        "variant) whose archive holds code: pickled weights or constants, custom or opaque objects, evaluated "
        "expressions, an AOTInductor package's native code. Unpickling runs arbitrary code: set only for sources "
        "you control."))

    @model_validator(mode="after")
    def _class_for_state_dict(self) -> "ModelSource":
        if self.format == "state_dict" and not self.class_path:
            raise ValueError("format 'state_dict' needs class_path ('module:Class') to load the weights into")
        return self


class DecodeSpec(SpecModel):
    """How a token_classification output (batch, time, classes) becomes the sequence that is compared
    (formulas: tailguard.core.tokens)."""

    kind: Literal["none", "ctc_greedy"] = Field("none", description=(
        "'none': the sequence is the top-1 class of every unmasked position; 'ctc_greedy': greedy CTC decoding "
        "(top-1 class per position, repeats collapsed, `blank` dropped), so sequence_exact_match and cer compare "
        "the decoded label sequences (OCR, ASR)."))
    blank: int = Field(0, ge=0, description="ctc_greedy: the class index of the CTC blank.")
    mask_input: str | None = Field(None, description=(
        "A model input (e.g. attention_mask) of shape (batch, time) whose 0 entries mark positions that are not "
        "compared (padding, special tokens); its time axis must be the output's. None: every position counts "
        "(declare one when inputs are padded per batch, or padded positions are compared too)."))


class ModelSpec(SpecModel):
    """The FP32 reference: an MLflow registered model version."""

    registered_name: str = Field(description="MLflow registered model holding the FP32 reference.")
    version: str | int = Field("latest", description=(
        "'latest', a version number (2 or '2', as `tailguard register` prints it), or '@alias'. The trigger "
        "overrides it."))
    task: ModelTask = Field(description="Decides the parity metrics (see components/validate/README.md).")
    inputs: list[TensorSpec] = Field(min_length=1, description="Model inputs, in forward() order.")
    outputs: list[TensorSpec] = Field(min_length=1, description="Model outputs; the first is compared for parity.")
    source: ModelSource = Field(default_factory=ModelSource, description="Storage format and trust.")
    export: ExportSpec = Field(default_factory=ExportSpec, description="torch -> ONNX export settings.")
    pad_values: dict[str, float] = Field(default_factory=dict, description=(
        "Value used to pad each variable-length input per batch (default 0; attention masks pad with 0)."))
    decode: DecodeSpec | None = Field(None, description=(
        "task token_classification only: the mask input and the decoding (greedy CTC) of the compared output "
        "(default: no mask, no decoding)."))

    @model_validator(mode="after")
    def _token_outputs(self) -> "ModelSpec":
        rank = len(self.outputs[0].shape)
        name = self.outputs[0].name
        if self.task == "classification" and rank == 3:
            raise ValueError(f"outputs.0.shape: {name} has 3 axes {self.outputs[0].shape} (batch, time, classes), "
                             "but task classification compares one class per row; use task: token_classification "
                             "(per-position agreement, sequence exact match, cer with decode kind ctc_greedy)")
        if self.task == "token_classification" and rank != 3:
            raise ValueError(f"outputs.0.shape: task token_classification compares (batch, time, classes) "
                             f"outputs; {name} has {rank} axes {self.outputs[0].shape}: declare [batch, time, C] "
                             "or choose another task")
        if self.decode is not None:
            if self.task != "token_classification":
                raise ValueError(f"decode: applies to model.task token_classification, not {self.task!r}; remove it")
            names = [t.name for t in self.inputs]
            if self.decode.mask_input is not None and self.decode.mask_input not in names:
                raise ValueError(f"decode.mask_input: {self.decode.mask_input!r} is not a model input "
                                 f"({names}); name one of them or remove mask_input")
            c = self.outputs[0].shape[-1]
            if self.decode.kind == "ctc_greedy" and isinstance(c, int) and self.decode.blank >= c:
                raise ValueError(f"decode.blank: {self.decode.blank} is not a class of {name} ({c} classes)")
        return self

    @model_validator(mode="after")
    def _output_kinds(self) -> "ModelSpec":
        for i, t in enumerate(self.inputs):
            if t.kind is not None:
                raise ValueError(f"inputs.{i}.kind: kind applies to outputs only (logits or probabilities); "
                                 "remove it from the input")
        for i, t in enumerate(self.outputs):
            if t.kind is not None and self.task not in ("classification", "token_classification"):
                raise ValueError(f"outputs.{i}.kind: {t.kind!r} applies to model.task classification (and "
                                 f"token_classification), not "
                                 f"{self.task!r}; remove it")
        return self

    @field_validator("version")
    @classmethod
    def _version(cls, v: str | int) -> str:
        v = str(v)  # an integer version (YAML `version: 2`) is the same version as the string "2"
        if v == "latest" or re.fullmatch(r"[1-9]\d*", v) or re.fullmatch(r"@[A-Za-z0-9_\-]+", v):
            return v
        raise ValueError("must be 'latest', a positive version number, or '@alias'")
