"""One error family for tailguard, each error carrying its CLI exit code (0 ok, 1 runtime, 2 bad input, 3 no passing
variant).

Exit codes (a contract): 0 ok/promoted, 1 runtime error (includes a failed data check),
2 bad spec / bad input / usage, 3 ran but no variant passed the gates, 4 monitor alert(s) fired.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_NO_PASSING_VARIANT = 3
EXIT_ALERT = 4


class TailguardError(Exception):
    """Base of every error tailguard raises on purpose.

    Attributes:
        exit_code: the CLI exit code this error maps to (EXIT_* above).
        hint: one line telling the user how to fix it, or "".
    """

    exit_code: int = EXIT_RUNTIME

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable record of the error (written by KFP tasks, read by the CLI)."""
        return {"type": type(self).__name__, "message": self.message, "hint": self.hint,
                "exit_code": self.exit_code}

    def __str__(self) -> str:
        return self.message + (f"\n  fix: {self.hint}" if self.hint else "")


@dataclass(frozen=True)
class FieldError:
    """One problem in a spec: `loc` is the dotted field path (e.g. `variants.2.quantization.mode`)."""

    loc: str
    message: str
    value: Any = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.loc or '<root>'}: {self.message}"


class SpecError(TailguardError):
    """What the user wrote is wrong: an invalid spec, with every problem and its field path (exit 2)."""

    exit_code = EXIT_USAGE

    def __init__(self, errors: list[FieldError], *, source: str = "spec", hint: str = "") -> None:
        self.errors = list(errors)
        self.source = source
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"{source}: {len(self.errors)} error(s)\n{lines}", hint=hint)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["errors"] = [{"loc": e.loc, "message": e.message} for e in self.errors]
        return d


class InputError(TailguardError):
    """A referenced input is missing or unusable: a file, a registry version, a corrupt model (exit 2).

    Args:
        message: what is wrong, naming the file / field / version.
        hint: how to fix it.
    """

    exit_code = EXIT_USAGE


class UntrustedModelError(InputError):
    """The registry version holds a pickled model and the spec does not mark its source as trusted (exit 2)."""


class DataCheckError(TailguardError):
    """The Great Expectations suite failed on the calibration or validation data (exit 1).

    Attributes:
        failures: one dict per failed expectation: dataset, expectation, column, observed.
    """

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, failures: list[dict[str, Any]] | None = None, *, hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.failures = failures or []

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["failures"] = self.failures
        return d


class ExportMismatchError(TailguardError):
    """The exported ONNX graph disagrees with the source model beyond the per-output tolerance (exit 1).

    Attributes:
        diffs: {output name: {"max_abs_diff": float, "atol": float, "rtol": float, "ok": bool}}.
    """

    exit_code = EXIT_RUNTIME

    def __init__(self, diffs: dict[str, dict[str, float]]) -> None:
        self.diffs = diffs
        bad = ", ".join(f"{k}: max |diff| {v['max_abs_diff']:.3g} (atol {v['atol']:g}, rtol {v['rtol']:g})"
                        for k, v in diffs.items() if not v["ok"])
        super().__init__(f"exported ONNX outputs differ from the source model: {bad}",
                         hint="check unsupported ops in the export, or raise model.export.tolerances "
                              "for that output if the difference is expected")

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["diffs"] = self.diffs
        return d


class StepError(TailguardError):
    """A pipeline step failed at run time (exit 1). Carries the step, the variant (if any) and a log path."""

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, *, step: str, variant: str | None = None, log_path: str | None = None,
                 hint: str = "") -> None:
        self.step, self.variant, self.log_path = step, variant, log_path
        where = f"[{step}{'/' + variant if variant else ''}] "
        super().__init__(where + message + (f" (log: {log_path})" if log_path else ""), hint=hint)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.update(step=self.step, variant=self.variant, log_path=self.log_path)
        return d


class RunInterrupted(TailguardError):
    """A local run was stopped by SIGINT / SIGTERM (exit 1): its parent MLflow run is marked FAILED with the
    reason in its description."""


class MissingDependencyError(ImportError, TailguardError):
    """An optional dependency (TensorRT, onnxruntime-gpu, CUDA) is missing; names the pip extra to install."""

    exit_code = EXIT_RUNTIME

    def __init__(self, package: str, extra: str) -> None:
        TailguardError.__init__(self, f"{package} is not installed",
                                hint=f"pip install 'tailguard[{extra}]' on a machine with an NVIDIA GPU")
        ImportError.__init__(self, f"{package} is not installed; pip install 'tailguard[{extra}]'")


def error_from_dict(d: dict[str, Any]) -> TailguardError:
    """Rebuild a (generic) TailguardError from `TailguardError.to_dict()` output, keeping the exit code."""
    err = TailguardError(d.get("message", "unknown error"), hint=d.get("hint", ""))
    err.exit_code = int(d.get("exit_code", EXIT_RUNTIME))
    err.record = d  # type: ignore[attr-defined]
    return err


def dumps_error(err: TailguardError) -> str:
    """JSON text of an error record (see `TailguardError.to_dict`)."""
    return json.dumps(err.to_dict(), default=str)
