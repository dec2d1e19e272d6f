"""Turn a spec into a KFP v2 pipeline: the one definition used by local runs and by `tailguard compile`.

DAG (variants unrolled from the spec, so each gets its own task names and, for GPU backends, its own
node-pool settings):

    check-data -> resolve -> fetch-reference -> export -> reference-pass
                                                      \\-> build-<variant> -> validate-<variant>  (one pair per variant)
                                                         (with `serving_targets`: validate-<variant>-on-<target>, one
                                                          per target serving the variant, on the target's pool)
                                                                        -> search-<variant>  (with `search:` only)
    register-and-promote  (after every validate and search task; logs reference-pass's baselines to the parent
                           run, reads the nested MLflow runs)
    finalize-run  (cluster form: the exit handler around every task after check-data; marks the parent run
                   FAILED with the first task error when the pipeline fails or is cancelled)

State that crosses tasks: model files as KFP artifacts; metrics and decisions in MLflow (the parent
run id is a task output). reference-pass's baselines and calibration coverage travel as its outputs and are
logged to the parent run by register-and-promote.

Caching: on the cluster KFP's execution cache is on for the pure tasks only (fetch-reference, export,
reference-pass and build-<variant>: they write artifacts, never MLflow; `tailguard compile --no-cache` turns it
off); every MLflow-writing task stays uncached. KFP keys a task on its input parameter values, its input
artifacts (their producers' outputs) and its component, so two things keep a gate change from invalidating the
pure tasks:
  - they receive `step_spec_yaml(spec)` (build-<variant>: `step_spec_yaml(spec, variant)`), a compile-time
    constant in which what the task does not read (gates, promotion, monitoring, cost, labels, the other
    variants, ...) has fixed canonical values, not the `spec_yaml` parameter; the MLflow-writing tasks keep it;
  - fetch-reference, not resolve, produces the `reference` artifact they read: resolve opens the parent MLflow
    run, is uncached and makes a new artifact every run, while fetch-reference's inputs are the concrete
    version and SHA-256 resolve found, so it hits and hands on its cached artifact.
Local runs use tailguard's own cache instead (tailguard.core.cache).

Task names: each task's KFP name is the name above (`build-<variant>`, not KFP's `build-variant-2`), the same in
the compiled IR and in kfp.local's logs (`named`).
"""

# no `from __future__ import annotations`: KFP reads the pipeline function's annotations as types

from typing import Any, Callable

from tailguard.core.spec.root import Spec
from tailguard.core.spec.targets import ServingTarget, target_task_name
from tailguard.core.spec.variants import VariantSpec

PARAMS = ("spec_yaml", "tracking_uri", "model_version", "pipeline_run")


def _image_for(spec: Spec, gpu: bool) -> "str | None":
    kf = spec.kubeflow
    return (kf.gpu_image or kf.image) if gpu else kf.image


# Tasks that are pure functions of their inputs (no MLflow writes): KFP may serve them from its cache.
def is_pure(name: str) -> bool:
    """Whether the task named `name` is pure: "fetch-reference", "export", "reference-pass" or "build-<variant>"."""
    return name in ("fetch-reference", "export", "reference-pass") or name.startswith("build-")


def step_spec_yaml(spec: Spec, variant: "str | None" = None) -> str:
    """The spec as a pure task sees it, YAML (`dump_spec`): export and reference-pass (`variant` None) or
    build-<variant> (`variant` its name).

    What the task reads is its declaration in `tailguard.core.spec.reads` (`EXPORT`, `REFERENCE_PASS`, `BUILD`):
    model (but `model.version`), data (but `data.expectations`), slices, benchmark, `analysis.sensitivity`,
    `metadata.name`, and for a build its own variant (its `search` only by its presence: the build's sensitivity
    ranking is skipped for a variant with a search). Everything else gets its default (`reads.step_view`), so that
    changing it leaves their inputs, and so KFP's cache key, unchanged: `gates` [] with `promotion` {enabled:
    false} (valid without a parity gate), `monitoring` and `cost` None, `metadata.labels` {}, `mlflow`,
    `kubeflow`, the rest of `analysis`, `serving_targets` and `data.expectations` at their defaults,
    `model.version` "latest" (the concrete version reaches them as fetch-reference's artifact), and `variants`:
    only the build's own variant, or for export and reference-pass one canonical FP32 variant
    (`reads.CANONICAL_VARIANT`). reference-pass's one read of `gates` (the batch sizes of its speed gates) is
    its cache key's (`timing_gates_key`), not its spec's.

    Args:
        spec: a validated spec.
        variant: a variant name of `spec`, or None.

    Returns:
        YAML text that `spec_from_yaml` accepts; the same for two specs that differ only in what the task does
        not read.

    Raises:
        KeyError: `variant` is not a variant of `spec`.
    """
    from tailguard.core.spec import dump_spec, parse_spec
    from tailguard.core.spec.reads import BUILD, EXPORT, step_view

    doc = spec.model_dump(mode="json", exclude_none=False)
    return dump_spec(parse_spec(step_view(doc, EXPORT if variant is None else BUILD, variant)))


def named(component: Any, name: str) -> Any:
    """A copy of the KFP `component` whose spec name is `name`, so that the task it makes is named `name`.

    KFP names a task after its component's spec name, made unique with -2, -3, ...
    (kfp.dsl.pipeline_context.Pipeline.add_task): one component called once per variant gives build-variant,
    build-variant-2. A copy per task named build-<variant> gives the task that name in the compiled IR and in
    kfp.local's runs alike (kfp.local runs the compiled spec), so logs, per-task timings and the IR agree.
    The copy shares the original's function and container; only the spec's name differs.

    Args:
        component: a `@dsl.component` (kfp.dsl.base_component.BaseComponent).
        name: the task name, a DNS-1123 label (variant names are, spec.VariantSpec.name).

    Raises:
        ValueError: `name` is not a DNS-1123 label (KFP would rename it).
    """
    import copy
    import dataclasses

    clone = copy.copy(component)
    clone.component_spec = dataclasses.replace(component.component_spec, name=name)
    if clone.component_spec.name != name:
        raise ValueError(f"task name {name!r} is not a DNS-1123 label (KFP would name it "
                         f"{clone.component_spec.name!r})")
    clone.name = name
    return clone


def _configure_task(task: Any, spec: Spec, *, name: str, gpu: bool, cluster: bool, cache: bool = True,
                    target: "ServingTarget | None" = None) -> Any:
    """Display name (= the task name, `named`), caching (on the cluster, for pure tasks unless `cache` is False;
    off locally: kfp.local has no cache, tailguard.core.cache serves local runs), and (for the cluster) image, GPU
    resources, node pool and secrets. With `target` (a validate task on a serving target) the node pool and
    accelerator are the target's (`_place_on_target`) instead of `kubeflow.gpu`'s."""
    task.set_display_name(name)
    task.set_caching_options(cluster and cache and is_pure(name))
    if not cluster:
        return task
    image = _image_for(spec, gpu)
    if image and task.container_spec is not None:
        task.container_spec.image = image
    from kfp import kubernetes

    for secret in spec.kubeflow.secrets:
        kubernetes.use_secret_as_env(task, secret_name=secret.name,
                                     secret_key_to_env={key: env for env, key in secret.env.items()})
    if target is not None:
        _place_on_target(task, target)
    elif gpu:
        pool = spec.kubeflow.gpu
        task.set_accelerator_type(pool.accelerator_type)
        task.set_accelerator_limit(pool.count)
        for label, value in pool.node_selector.items():
            kubernetes.add_node_selector(task, label_key=label, label_value=value)
        for t in pool.tolerations:
            kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value, effect=t.effect)
    return task


def _place_on_target(task: Any, target: ServingTarget) -> None:
    """Schedule `task` on serving target `target`'s pool (kfp-kubernetes, as the GPU settings): its accelerator
    (type and count), node selector and tolerations."""
    from kfp import kubernetes

    if target.accelerator is not None:
        task.set_accelerator_type(target.accelerator.type)
        task.set_accelerator_limit(target.accelerator.count)
    for label, value in target.node_selector.items():
        kubernetes.add_node_selector(task, label_key=label, label_value=value)
    for t in target.tolerations:
        kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value, effect=t.effect)


def build_pipeline(spec: Spec, *, cluster: bool = False, exit_handler: "bool | None" = None,
                   cache: bool = True) -> Callable[..., Any]:
    """A `@dsl.pipeline` function for `spec`.

    Args:
        spec: a validated spec (its variants become tasks).
        cluster: add what only a cluster uses (images, GPU requests, node selectors, tolerations, secrets).
            Local runs leave them out; the DAG is the same.
        exit_handler: wrap every task after check-data in a `dsl.ExitHandler` whose exit task (finalize-run)
            marks the parent MLflow run FAILED, with the first task error as its description, when the pipeline
            fails or is cancelled. Default: on for the cluster, off locally (the local runner closes the run and
            needs the pipeline's output, which KFP cannot compile beside an exit handler).
        cache: with `cluster`, turn KFP's execution cache on for the pure tasks (fetch-reference, export,
            reference-pass, build-<variant>); False
            (`tailguard compile --no-cache`) leaves it off for every task.

    Returns:
        The pipeline function; parameters spec_yaml, tracking_uri, model_version ('' = the spec's), pipeline_run
        (a label for the parent run). Without the exit handler it returns the run summary JSON
        (register-and-promote's output); with it, nothing (the summary is summary.json on the parent run).
    """
    from kfp import dsl

    from tailguard.components.build.component import build_torch_variant, build_variant
    from tailguard.components.build.registry import get_builder
    from tailguard.components.check_data.component import check_data
    from tailguard.components.export.component import export
    from tailguard.components.finalize.component import finalize_run
    from tailguard.components.reference.component import reference_pass
    from tailguard.components.register.component import register_and_promote
    from tailguard.components.resolve.component import fetch_reference, resolve
    from tailguard.components.search.component import search_variant
    from tailguard.components.validate.component import validate_variant, validate_variant_on_target

    variants: list[VariantSpec] = list(spec.variants)
    # compile-time constants of the pure tasks (see the module docstring, Caching); each build gets its own
    pure_spec = step_spec_yaml(spec)
    model_json = spec.model.model_copy(update={"version": "latest"}).model_dump_json()
    registry_uri = spec.mlflow.registry_uri or ""
    if exit_handler is None:
        exit_handler = cluster

    def task(component: Any, name: str, gpu: bool = False, target: "ServingTarget | None" = None,
             **inputs: Any) -> Any:
        """The task `name` of `component` with `inputs`, configured (`named`, `_configure_task`)."""
        return _configure_task(named(component, name)(**inputs), spec, name=name, gpu=gpu, cluster=cluster,
                               cache=cache, target=target)

    def steps(chk: Any, spec_yaml: str, tracking_uri: str, model_version: str, pipeline_run: str) -> Any:
        """Every task after check-data `chk` but the exit handler; returns register-and-promote's task."""
        res = task(resolve, "resolve", spec_yaml=spec_yaml, tracking_uri=tracking_uri, model_version=model_version,
                   pipeline_run=pipeline_run, kfp_run=dsl.PIPELINE_JOB_ID_PLACEHOLDER).after(chk)
        parent_run_id = res.outputs["parent_run_id"]
        # resolve keeps its own download (the parent run's tags need the format and SHA-256); fetch-reference
        # downloads the same version again as a pure, cacheable task whose artifact export and reference-pass read
        fetch = task(fetch_reference, "fetch-reference", tracking_uri=tracking_uri, model_json=model_json,
                     version=res.outputs["version"], sha256=res.outputs["sha256"], registry_uri=registry_uri)
        exp = task(export, "export", spec_yaml=pure_spec, resolved=fetch.outputs["resolved"],
                   reference=fetch.outputs["reference"])
        ref = task(reference_pass, "reference-pass", spec_yaml=pure_spec, resolved=fetch.outputs["resolved"],
                   reference=fetch.outputs["reference"], onnx_model=exp.outputs["onnx_model"])
        validations, searches = [], []
        for v in variants:
            if get_builder(v.backend).source == "torch":  # built from the torch reference, not the ONNX export
                build = task(build_torch_variant, f"build-{v.name}", v.needs_gpu,
                             spec_yaml=step_spec_yaml(spec, v.name), variant_name=v.name,
                             resolved=fetch.outputs["resolved"], reference=fetch.outputs["reference"])
            else:
                build = task(build_variant, f"build-{v.name}", v.needs_gpu, spec_yaml=step_spec_yaml(spec, v.name),
                             variant_name=v.name,
                             onnx_model=exp.outputs["onnx_model"])
            inputs = dict(spec_yaml=spec_yaml, variant_name=v.name, build=build.outputs["Output"],
                          baselines=ref.outputs["Output"], parent_run_id=parent_run_id, tracking_uri=tracking_uri,
                          variant_model=build.outputs["variant_model"], reference_outputs=ref.outputs["outputs"],
                          reference_model=exp.outputs["onnx_model"])
            if spec.serving_targets:  # one validation per serving target, on its pool (no search: spec check)
                validations += [task(validate_variant_on_target, target_task_name(v.name, t.name), v.needs_gpu,
                                     target=t, target_name=t.name, placement="node_pool" if cluster else "this_node",
                                     **inputs) for t in spec.targets_for(v)]
                continue
            val = task(validate_variant, f"validate-{v.name}", v.needs_gpu, **inputs)
            validations.append(val)
            if v.search is not None:
                # after its validation (it reads the verdict and logs under the variant's run); runs where the
                # variant runs (same image and node pool: the trials are timed on that hardware)
                searches.append(task(search_variant, f"search-{v.name}", v.needs_gpu, spec_yaml=spec_yaml,
                                     variant_name=v.name, validation=val.outputs["Output"],
                                     baselines=ref.outputs["Output"], parent_run_id=parent_run_id,
                                     tracking_uri=tracking_uri, onnx_model=exp.outputs["onnx_model"],
                                     reference_outputs=ref.outputs["outputs"]))
        return task(register_and_promote, "register-and-promote", spec_yaml=spec_yaml,
                    resolved=res.outputs["resolved"], parent_run_id=parent_run_id, tracking_uri=tracking_uri,
                    baselines=ref.outputs["Output"],
                    reference_outputs=ref.outputs["outputs"], fetched=fetch.outputs["resolved"],
                    reference=fetch.outputs["reference"],
                    onnx_model=exp.outputs["onnx_model"]).after(*validations, *searches)

    name = spec.metadata.name
    description = (f"tailguard: optimize and validate {spec.model.registered_name} ({len(variants)} variants), "
                   f"promote by alias '{spec.promotion.alias}'")
    if not exit_handler:
        @dsl.pipeline(name=name, description=description)
        def tailguard_pipeline(spec_yaml: str, tracking_uri: str, model_version: str = "",
                               pipeline_run: str = "") -> str:
            chk = task(check_data, "check-data", spec_yaml=spec_yaml)
            return steps(chk, spec_yaml, tracking_uri, model_version, pipeline_run).outputs["Output"]

        return tailguard_pipeline

    @dsl.pipeline(name=name, description=description)
    def tailguard_pipeline_with_exit_handler(spec_yaml: str, tracking_uri: str, model_version: str = "",
                                             pipeline_run: str = ""):
        # KFP cannot compile a pipeline output beside an ExitHandler: this form returns nothing (the summary is
        # summary.json on the parent MLflow run). check-data opens no MLflow run, so it stays outside.
        chk = task(check_data, "check-data", spec_yaml=spec_yaml)
        fin = task(finalize_run, "finalize-run", spec_yaml=spec_yaml, tracking_uri=tracking_uri,
                   kfp_run=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        with dsl.ExitHandler(fin, name="close-parent-run"):
            steps(chk, spec_yaml, tracking_uri, model_version, pipeline_run)

    return tailguard_pipeline_with_exit_handler


def build_redecide_pipeline(spec: Spec) -> Callable[..., Any]:
    """The local pipeline of a gate-only re-run (tailguard.rerun): one task, `redecide` (components/redecide), that
    resolves the reference, decides every variant's new gates on the earlier run's stored measurements, logs the
    runs, registers and promotes, or decides nothing and says why.

    Returns:
        The pipeline function; parameters spec_yaml, tracking_uri, model_version, pipeline_run and earlier (the
        JSON of `rerun.earlier_run`); it returns the task's output (the run summary JSON, or
        {"redecide_fallback": reason}).
    """
    from kfp import dsl

    from tailguard.components.redecide.component import redecide

    @dsl.pipeline(name=spec.metadata.name,
                  description=f"tailguard: decide {spec.model.registered_name}'s variants again on stored measurements")
    def tailguard_redecide(spec_yaml: str, tracking_uri: str, model_version: str = "", pipeline_run: str = "",
                           earlier: str = "") -> str:
        t = _configure_task(named(redecide, "redecide")(spec_yaml=spec_yaml, tracking_uri=tracking_uri,
                                                        model_version=model_version, pipeline_run=pipeline_run,
                                                        earlier=earlier),
                            spec, name="redecide", gpu=False, cluster=False)
        return t.outputs["Output"]

    return tailguard_redecide


def compile_pipeline(spec: Spec, out_path: str, *, cache: bool = True) -> str:
    """Compile the cluster form of the pipeline to KFP IR YAML at `out_path`; returns the path.

    `cache`: KFP's execution cache on for the pure tasks (default), or off for every task (False). Every URI
    compiled into the IR has its credentials replaced by `***` (`tailguard.core.redact.redacted_spec`): pods get
    them from their environment (MLFLOW_TRACKING_USERNAME / _PASSWORD, AWS_* or workload identity).
    """
    from kfp import compiler

    from tailguard.core.redact import redacted_spec

    compiler.Compiler().compile(build_pipeline(redacted_spec(spec), cluster=True, cache=cache),
                                package_path=out_path)
    return out_path
