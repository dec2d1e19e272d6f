"""Turn a spec into a KFP v2 pipeline: the one builder used by local runs and by `tailguard compile`.

DAG (variants unrolled from the spec, so each gets its own task names and, for GPU backends, its own
node-pool settings):

    check-data -> resolve -> export -> reference-pass
                                    \\-> build-<variant> -> validate-<variant>   (one pair per variant)
                                                         -> search-<variant>   (variants with `search:` only)
    register-and-promote  (after every validate and search task; reads the nested MLflow runs)
    finalize-run  (cluster form: the exit handler around every task after check-data; marks the parent run
                   FAILED with the first task error when the pipeline fails or is cancelled)

State that crosses tasks: model files as KFP artifacts; metrics and decisions in MLflow (the parent
run id is a task output). Caching: on the cluster KFP's execution cache is on for the pure tasks only (export
and build-<variant>: they write artifacts, never MLflow; `tailguard compile --no-cache` turns it off); every
MLflow-writing task stays uncached. Local runs use tailguard's own cache instead (tailguard.cache).
"""

# no `from __future__ import annotations`: KFP reads the pipeline function's annotations as types

from typing import Any, Callable

from tailguard.core.spec import Spec, VariantSpec

PARAMS = ("spec_yaml", "tracking_uri", "model_version", "pipeline_run")


def _image_for(spec: Spec, gpu: bool) -> "str | None":
    kf = spec.kubeflow
    return (kf.gpu_image or kf.image) if gpu else kf.image


# Tasks that are pure functions of their inputs (no MLflow writes): KFP may serve them from its cache.
# reference-pass is not among them: it logs the FP32 baselines and calibration coverage to the parent run.
def is_pure(name: str) -> bool:
    """Whether the task named `name` (display name) is pure: "export" or "build-<variant>"."""
    return name == "export" or name.startswith("build-")


def _configure_task(task: Any, spec: Spec, *, name: str, gpu: bool, cluster: bool, cache: bool = True) -> Any:
    """Display name, caching (on the cluster, for pure tasks unless `cache` is False; off locally: kfp.local has
    no cache, tailguard.cache serves local runs), and (for the cluster) image, GPU resources, node pool and
    secrets."""
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
    if gpu:
        pool = spec.kubeflow.gpu
        task.set_accelerator_type(pool.accelerator_type)
        task.set_accelerator_limit(pool.count)
        for label, value in pool.node_selector.items():
            kubernetes.add_node_selector(task, label_key=label, label_value=value)
        for t in pool.tolerations:
            kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value, effect=t.effect)
    return task


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
        cache: with `cluster`, turn KFP's execution cache on for the pure tasks (export, build-<variant>); False
            (`tailguard compile --no-cache`) leaves it off for every task.

    Returns:
        The pipeline function; parameters spec_yaml, tracking_uri, model_version ('' = the spec's), pipeline_run
        (a label for the parent run). Without the exit handler it returns the run summary JSON
        (register-and-promote's output); with it, nothing (the summary is summary.json on the parent run).
    """
    from kfp import dsl

    from tailguard.components.check_data.component import check_data
    from tailguard.components.export.component import export, reference_pass
    from tailguard.components.finalize.component import finalize_run
    from tailguard.components.quantize.component import build_variant
    from tailguard.components.register.component import register_and_promote
    from tailguard.components.resolve.component import resolve
    from tailguard.components.search.component import search_variant
    from tailguard.components.validate.component import validate_variant

    variants: list[VariantSpec] = list(spec.variants)
    if exit_handler is None:
        exit_handler = cluster

    def cfg(task: Any, name: str, gpu: bool = False) -> Any:
        return _configure_task(task, spec, name=name, gpu=gpu, cluster=cluster, cache=cache)

    def steps(chk: Any, spec_yaml: str, tracking_uri: str, model_version: str, pipeline_run: str) -> Any:
        """Every task after check-data `chk` but the exit handler; returns register-and-promote's task."""
        res = cfg(resolve(spec_yaml=spec_yaml, tracking_uri=tracking_uri, model_version=model_version,
                          pipeline_run=pipeline_run, kfp_run=dsl.PIPELINE_JOB_ID_PLACEHOLDER), "resolve").after(chk)
        exp = cfg(export(spec_yaml=spec_yaml, resolved=res.outputs["resolved"],
                         reference=res.outputs["reference"]), "export")
        ref = cfg(reference_pass(spec_yaml=spec_yaml, resolved=res.outputs["resolved"],
                                 parent_run_id=res.outputs["parent_run_id"], tracking_uri=tracking_uri,
                                 reference=res.outputs["reference"], onnx_model=exp.outputs["onnx_model"]),
                  "reference-pass")
        validations, searches = [], []
        for v in variants:
            build = cfg(build_variant(spec_yaml=spec_yaml, variant_name=v.name,
                                      onnx_model=exp.outputs["onnx_model"]), f"build-{v.name}", v.needs_gpu)
            val = cfg(validate_variant(spec_yaml=spec_yaml, variant_name=v.name, build=build.outputs["Output"],
                                       baselines=ref.outputs["Output"], parent_run_id=res.outputs["parent_run_id"],
                                       tracking_uri=tracking_uri, variant_model=build.outputs["variant_model"],
                                       reference_outputs=ref.outputs["outputs"],
                                       reference_model=exp.outputs["onnx_model"]),
                      f"validate-{v.name}", v.needs_gpu)
            validations.append(val)
            if v.search is not None:
                # after its validation (it reads the verdict and logs under the variant's run); runs where the
                # variant runs (same image and node pool: the trials are timed on that hardware)
                searches.append(cfg(search_variant(spec_yaml=spec_yaml, variant_name=v.name,
                                                   validation=val.outputs["Output"], baselines=ref.outputs["Output"],
                                                   parent_run_id=res.outputs["parent_run_id"],
                                                   tracking_uri=tracking_uri, onnx_model=exp.outputs["onnx_model"],
                                                   reference_outputs=ref.outputs["outputs"]),
                                    f"search-{v.name}", v.needs_gpu))
        return cfg(register_and_promote(spec_yaml=spec_yaml, resolved=res.outputs["resolved"],
                                        parent_run_id=res.outputs["parent_run_id"], tracking_uri=tracking_uri),
                   "register-and-promote").after(*validations, *searches)

    name = spec.metadata.name
    description = (f"tailguard: optimize and validate {spec.model.registered_name} ({len(variants)} variants), "
                   f"promote by alias '{spec.promotion.alias}'")
    if not exit_handler:
        @dsl.pipeline(name=name, description=description)
        def tailguard_pipeline(spec_yaml: str, tracking_uri: str, model_version: str = "",
                               pipeline_run: str = "") -> str:
            chk = cfg(check_data(spec_yaml=spec_yaml), "check-data")
            return steps(chk, spec_yaml, tracking_uri, model_version, pipeline_run).outputs["Output"]

        return tailguard_pipeline

    @dsl.pipeline(name=name, description=description)
    def tailguard_pipeline_with_exit_handler(spec_yaml: str, tracking_uri: str, model_version: str = "",
                                             pipeline_run: str = ""):
        # KFP cannot compile a pipeline output beside an ExitHandler: this form returns nothing (the summary is
        # summary.json on the parent MLflow run). check-data opens no MLflow run, so it stays outside.
        chk = cfg(check_data(spec_yaml=spec_yaml), "check-data")
        fin = cfg(finalize_run(spec_yaml=spec_yaml, tracking_uri=tracking_uri,
                               kfp_run=dsl.PIPELINE_JOB_ID_PLACEHOLDER), "finalize-run")
        with dsl.ExitHandler(fin, name="close-parent-run"):
            steps(chk, spec_yaml, tracking_uri, model_version, pipeline_run)

    return tailguard_pipeline_with_exit_handler


def compile_pipeline(spec: Spec, out_path: str, *, cache: bool = True) -> str:
    """Compile the cluster form of the pipeline to KFP IR YAML at `out_path`; returns the path.

    `cache`: KFP's execution cache on for the pure tasks (default), or off for every task (False).
    """
    from kfp import compiler

    compiler.Compiler().compile(build_pipeline(spec, cluster=True, cache=cache), package_path=out_path)
    return out_path
