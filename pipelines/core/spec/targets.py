"""The spec's `kubeflow` section (images, the GPU node pool, secrets) and its `serving_targets` (the node pools a
variant will serve on, each with its accelerator and the ISA / compute capability its nodes must have), with the
names derived from a target: its validate task (`target_task_name`) and registry alias (`target_alias`).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from tailguard.core.hardware import KERNEL_ISA_FLAGS
from tailguard.core.spec.base import NAME_RE, SpecModel
from tailguard.core.spec.variants import VariantSpec


# ---------------------------------------------------------------------- kubeflow and serving targets
class Toleration(SpecModel):
    """A Kubernetes toleration for GPU node pools."""

    key: str = Field(description="Taint key, e.g. nvidia.com/gpu.")
    operator: Literal["Exists", "Equal"] = Field("Exists", description="Toleration operator.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        "NoSchedule", description="Taint effect.")


class GpuPoolSpec(SpecModel):
    """Scheduling of GPU steps on a GPU node pool."""

    accelerator_type: str = Field("nvidia.com/gpu", description="dsl set_accelerator_type value.")
    count: int = Field(1, ge=1, description="GPUs per GPU step.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels for GPU steps.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations for GPU steps.")


class SecretRef(SpecModel):
    """A Kubernetes secret mounted as environment variables: {ENV_VAR: secret key}."""

    name: str = Field(description="Secret name.")
    env: dict[str, str] = Field(description="Environment variable -> key in the secret.")


class KubeflowSpec(SpecModel):
    """Cluster settings for `tailguard compile` / `submit` (images, GPU node pool, secrets)."""

    image: str | None = Field(None, description="Default component image (CPU steps).")
    gpu_image: str | None = Field(None, description="Image for GPU steps (TensorRT base).")
    gpu: GpuPoolSpec = Field(default_factory=GpuPoolSpec, description="GPU node pool for GPU steps.")
    secrets: list[SecretRef] = Field(default_factory=list, description="Secrets as env vars, never parameters.")
    experiment: str | None = Field(None, description="KFP experiment name.")


def target_task_name(variant: str, target: str) -> str:
    """The KFP task that validates `variant` on serving target `target`: 'validate-<variant>-on-<target>'."""
    return f"validate-{variant}-on-{target}"


def target_alias(alias: str, target: str) -> str:
    """The registry alias of serving target `target`: '<promotion.alias>-<target>', e.g. 'production-avx512'."""
    return f"{alias}-{target}"


class AcceleratorSpec(SpecModel):
    """The accelerator a serving target's nodes carry (KFP `set_accelerator_type` / `set_accelerator_limit`)."""

    type: str = Field(description="Accelerator resource, e.g. nvidia.com/gpu (dsl set_accelerator_type value).")
    count: int = Field(1, ge=1, description="Accelerators per validate task on this target.")


class TargetExpect(SpecModel):
    """What a serving target's nodes must be, checked against the facts of the node a validate task ran on
    (tailguard.core.hardware.node_facts): a task on a node that does not match validates nothing and is marked
    skipped with the differences as its reason, never passed (issue 23)."""

    isa: list[str] = Field(default_factory=list, description=(
        "ISA flags the node's CPU must have, as /proc/cpuinfo spells them (one of " + ", ".join(KERNEL_ISA_FLAGS)
        + "), e.g. [avx512_vnni] for a pool of VNNI CPUs."))
    absent_isa: list[str] = Field(default_factory=list, description=(
        "ISA flags the node's CPU must not have, e.g. [avx512_vnni, avx_vnni] for a pool of AVX2-only CPUs (whose "
        "u8 x s8 INT8 kernel differs from a VNNI CPU's)."))
    compute_capability: list[str] = Field(default_factory=list, description=(
        "GPU compute capabilities allowed, e.g. ['8.9'] (L4) or ['9.0'] (H100): the node needs a visible GPU and "
        "every visible GPU must have one of them."))

    @field_validator("isa", "absent_isa")
    @classmethod
    def _known_flags(cls, v: list[str]) -> list[str]:
        unknown = [f for f in v if f not in KERNEL_ISA_FLAGS]
        if unknown:
            raise ValueError(f"unknown ISA flag(s) {unknown}: name flags that change kernels, one of "
                             f"{list(KERNEL_ISA_FLAGS)}")
        return v

    @field_validator("compute_capability")
    @classmethod
    def _capability_form(cls, v: list[str]) -> list[str]:
        bad = [c for c in v if not re.fullmatch(r"\d+\.\d+", str(c))]
        if bad:
            raise ValueError(f"compute capabilities are written major.minor, e.g. '8.9'; got {bad}")
        return v


class ServingTarget(SpecModel):
    """A node pool a variant will serve on (issue 23). With `serving_targets`, the validate step of each variant
    runs once per target that serves it, on that pool (`tailguard compile`), the gates hold per target and
    promotion moves `<promotion.alias>-<name>` to the fastest variant passing there (docs/spec.md, Serving
    targets)."""

    name: str = Field(pattern=NAME_RE, description=(
        "DNS-1123 name: part of the validate task's name (validate-<variant>-on-<name>) and of the per-target "
        "alias (<promotion.alias>-<name>, e.g. production-avx512)."))
    node_selector: dict[str, str] = Field(default_factory=dict, description=(
        "Node labels of the pool (kfp-kubernetes add_node_selector), e.g. {node.kubernetes.io/instance-type: "
        "c7i.2xlarge}."))
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations for the pool's taints.")
    accelerator: AcceleratorSpec | None = Field(None, description=(
        "The pool's accelerator. A target with one serves the GPU variants (TensorRT, a CUDA/TensorRT execution "
        "provider, `gpu: true`); a target without one serves the CPU variants."))
    expect: TargetExpect | None = Field(None, description=(
        "What the pool's nodes must be (ISA flags, compute capability), checked on the node each validate task "
        "ran on; a node that differs validates nothing (skipped, with the differences), never passes."))

    @property
    def gpu(self) -> bool:
        """True when the target carries an accelerator (it serves the GPU variants)."""
        return self.accelerator is not None

    def serves(self, variant: "VariantSpec") -> bool:
        """Whether `variant` serves on this target: GPU variants on targets with an accelerator, CPU variants on
        targets without one."""
        return variant.needs_gpu == self.gpu
