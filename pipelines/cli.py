"""The `tailguard` command line (typer + rich). Exit codes are a contract (README.md, docs/architecture.md):
0 ok / promoted, 1 runtime error, 2 bad spec / bad input / usage, 3 no variant passed the gates,
4 monitor alert(s) fired. A user error never ends in a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.table import Table

from tailguard.core.contract import GATES_TAG, VARIANT_TAG
from tailguard.core.errors import EXIT_NO_PASSING_VARIANT, EXIT_OK, EXIT_RUNTIME, SpecError, TailguardError
from tailguard.core.results import PromotionStatus

app = typer.Typer(help="tailguard: quantize/compile models, prove every variant against its FP32 reference per "
                       "slice and on the tail, promote the fastest passing one in MLflow.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
spec_app = typer.Typer(help="Validate specs and print their JSON Schema.", no_args_is_help=True)
monitor_app = typer.Typer(help="The shadow-traffic monitor.", no_args_is_help=True)
trigger_app = typer.Typer(help="Start runs when new model versions are registered (MLflow webhooks).",
                          no_args_is_help=True)
app.add_typer(spec_app, name="spec")
app.add_typer(monitor_app, name="monitor")
app.add_typer(trigger_app, name="trigger")
cache_app = typer.Typer(help="The local cache of pure steps (export, builds, reference outputs) under "
                             "$TAILGUARD_HOME/cache.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")

# The terminal presentation (consoles, the summary table, the progress bar) lives in tailguard.terminal, which
# the demo shares.
from tailguard.terminal import console, err_console, print_summary  # noqa: E402
from tailguard.terminal import run_with_progress as _run_with_progress  # noqa: E402


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn TailguardErrors into a message and their exit code; unexpected errors into exit 1 with a log file."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except TailguardError as err:
            print_error(err)
            raise typer.Exit(err.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[red]interrupted[/red]: no alias was moved")
            raise typer.Exit(EXIT_RUNTIME) from None
        except Exception as exc:  # a bug: keep the traceback in a file, not on the user's screen
            from tailguard.core.home import home

            path = home() / "last-error.txt"
            path.write_text(traceback.format_exc())
            err_console.print(f"[red]internal error[/red]: {type(exc).__name__}: {exc}\n  traceback: {path}")
            raise typer.Exit(EXIT_RUNTIME) from None

    return wrapper


def print_error(err: TailguardError) -> None:
    """Print an error the way every command does: kind, message, fix."""
    kind = type(err).__name__ if type(err) is not TailguardError else "error"
    record = getattr(err, "record", None)
    if record:
        kind = record.get("type", kind)
    from rich.text import Text

    err_console.print(Text.assemble((kind, "bold red"), ": ", err.message), soft_wrap=True)
    if err.hint:
        err_console.print(Text.assemble("  ", ("fix", "yellow"), ": ", err.hint), soft_wrap=True)


# ----------------------------------------------------------------------------------------------- spec
@spec_app.command("check")
@handle_errors
def spec_check(spec: Path = typer.Argument(..., help="Spec YAML file."),
               data: bool = typer.Option(True, "--data/--no-data", help=(
                   "Also check the local data files: they exist, have the model inputs' columns with rows of the "
                   "right rank and fixed sizes, and every column the spec names (remote s3:// files are not "
                   "read)."))) -> None:
    """Validate SPEC and, by default, its local data files; print every error with its field path at once
    (exit 2 when invalid)."""
    from tailguard.preflight import check_spec_file, unpassable_gate_warnings

    s, check = check_spec_file(spec, data=data)
    console.print(f"[green]valid[/green]: {spec} ({s.metadata.name}: {len(s.variants)} variants, "
                  f"{len(s.gates)} gates, {len(s.slices)} slices)")
    for warning in unpassable_gate_warnings(s):
        console.print(f"  [yellow]warning[/yellow]: {warning}", markup=True, highlight=False)
    if check is not None:
        for name, n in check.rows.items():
            console.print(f"  data.{name}: {n} rows checked (file, input columns and shapes, named columns)")
        for uri in check.remote:
            console.print(f"  [yellow]not checked[/yellow] (remote): {uri}; the run's data check reads it")
        if check.model:
            console.print(f"  {check.model}", markup=False)
    else:
        console.print("  data files not checked (--no-data)")


@spec_app.command("schema")
@handle_errors
def spec_schema(out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write to this file.")) -> None:
    """Print the spec's JSON Schema (docs/spec.schema.json holds a copy)."""
    from tailguard.core.spec import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if out:
        out.write_text(text)
        console.print(f"wrote {out}")
    else:
        sys.stdout.write(text)


# ------------------------------------------------------------------------------------------------ run
@app.command("run")
@handle_errors
def run(spec: Path = typer.Argument(..., help="Spec YAML file."),
        model_version: Optional[str] = typer.Option(None, "--model-version", help="'latest', a number or '@alias' "
                                                                                  "(overrides model.version)."),
        runner: str = typer.Option("local", "--runner", help="local (kfp.local, embedded MLflow) or kfp."),
        host: Optional[str] = typer.Option(None, "--host", help="KFP endpoint for --runner kfp."),
        summary_json: Optional[Path] = typer.Option(None, "--summary-json", help=(
            "Also write the summary here (JSON; per variant build_status and gates_status).")),
        no_cache: bool = typer.Option(False, "--no-cache", help="Run export, builds and the reference outputs even "
                                                                 "when $TAILGUARD_HOME/cache holds them."),
        model_path: Optional[list[Path]] = typer.Option(None, "--model-path", help=(
            "Folder to import a state dict's model class from (repeatable; local runs). The spec's folder is "
            "searched too, after the installed packages."))
        ) -> None:
    """One pipeline run for one model version. Exit 0 promoted (or promotion off), 3 no variant passed."""
    from tailguard.core.spec import load_spec

    s = load_spec(spec)
    from tailguard.preflight import check_columns

    check_columns(s, source=str(spec))
    model_dirs = _model_dirs(model_path, "--model-path") + [spec.resolve().parent]
    if runner == "kfp":
        if not host:
            raise SpecError([], source="--host", hint="--runner kfp needs --host URL of the KFP API")
        if model_path:
            from tailguard.core.errors import InputError

            raise InputError("--model-path: applies to local runs only; a cluster's steps import the model class "
                             "from their image", hint="install the package that defines the class in the component "
                                                      "images (docs/deploy.md), or run with --runner local")
        from tailguard.submit import submit

        run_id = submit(s, host=host, model_version=model_version)
        console.print(f"submitted: {run_id}")
        return
    if runner != "local":
        raise typer.BadParameter("--runner must be local or kfp")
    result = _run_with_progress(s, model_version, cache=not no_cache, model_path=model_dirs)
    summary = result.summary
    print_summary(summary)
    if summary_json:  # with build_status / gates_status per variant (runner.summary_document)
        from tailguard.runner import summary_document

        summary_json.write_text(json.dumps(summary_document(summary), indent=2))
    from tailguard.core.redact import redact_uri
    from tailguard.core.tracking import tracking_uri_for

    uri = redact_uri(tracking_uri_for(s))
    console.print(f"MLflow: {uri}  (parent run {summary.parent_run_id}; log {result.log_path})")
    console.print(f"report: report.html of the parent run, or `tailguard report {summary.parent_run_id} -o FILE`")
    for e in summary.target_aliases:  # serving targets: one alias per target, moved before the default one
        if e["outcome"] == PromotionStatus.PROMOTED:
            console.print(f"[green]promoted[/green] {summary.optimized_model} v{e['version']} ({e['variant']}) as "
                          f"@{e['alias']} (fastest passing on target {e['target']})")
        else:
            where = f"v{e['alias_version']}" if e.get("alias_version") else "nowhere"
            why = "superseded by a concurrent run" if e["outcome"] == PromotionStatus.SUPERSEDED else \
                f"no variant passed on target {e['target']}"
            console.print(f"@{e['alias']} stays at {where}: {why}")
    if summary.promoted_version:
        console.print(f"[green]promoted[/green] {summary.optimized_model} v{summary.promoted_version} "
                      f"({summary.promoted_variant}) as @{summary.alias}")
        raise typer.Exit(EXIT_OK)
    if summary.promotion == PromotionStatus.SUPERSEDED:
        console.print(f"[yellow]superseded[/yellow]: @{summary.alias} moved to v{summary.alias_version} while this "
                      "run ran and that version wins the comparison; this run's variants are registered, the alias "
                      "stays")
        raise typer.Exit(EXIT_OK)
    if not summary.any_passed:
        if summary.serving_targets:
            err_console.print(f"[red]no variant passed every gate on every serving target[/red]: @{summary.alias} "
                              "did not move (reasons in the table)")
            raise typer.Exit(EXIT_NO_PASSING_VARIANT)
        err_console.print("[red]no variant passed every gate[/red]: no alias moved (reasons in the table)")
        raise typer.Exit(EXIT_NO_PASSING_VARIANT)
    console.print("promotion is off: variants registered, no alias moved")


# --------------------------------------------------------------------------------------------- report
@app.command("report")
@handle_errors
def report(run_id: str = typer.Argument(..., metavar="RUN_ID|latest",
                                        help="Parent run id (as `tailguard run` printed it), a variant run id (its "
                                             "parent's report), or 'latest'."),
           output: Optional[Path] = typer.Option(None, "--output", "-o",
                                                 help="HTML file to write (default: ./report-<run id>.html)."),
           tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help=(
               "MLflow store holding the run (default: $MLFLOW_TRACKING_URI, else the local store under "
               "$TAILGUARD_HOME).")),
           ui_url: Optional[str] = typer.Option(None, "--ui-url", help=(
               "MLflow UI base URL for the links to the variant runs (default: the tracking server, or "
               "http://127.0.0.1:5000 for a local store)."))) -> None:
    """Write a run's report (variants table, Pareto plot, gate matrix, per-slice heat map, search trials, links to
    the variant runs) from the MLflow store: the same report.html the run logged. Exit 2 for an unknown run."""
    from tailguard.run_report import write_run_report_file

    path, parent = write_run_report_file(run_id, output, tracking_uri=tracking_uri, ui_url=ui_url)
    console.print(f"wrote {path} (parent run {parent})")


# ---------------------------------------------------------------------------------------------- bench
@app.command("bench")
@handle_errors
def bench(model: str = typer.Argument(..., metavar="MODEL@ALIAS|MODEL/VERSION", help=(
              "A version tailguard registered, e.g. minilm-lexname-optimized@production or "
              "minilm-lexname-optimized/3.")),
          spec: Path = typer.Option(..., "--spec", help="The spec it was built with (inputs, validation rows, "
                                                        "benchmark section)."),
          batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help=(
              "Rows per batch (default: promotion.batch_size, else the first benchmark batch size).")),
          tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help=(
              "MLflow store holding the registry (default: $MLFLOW_TRACKING_URI, else the local store under "
              "$TAILGUARD_HOME)."))) -> None:
    """Time a registered version against torch eager and the ONNX FP32 export in one interleaved run (the
    promotion's paired rounds) and print the run table's row for it, every speed-up with its bounds. Exit 2 for
    an unknown model or a bad spec, 1 when it cannot be timed here."""
    from tailguard.bench import bench_model
    from tailguard.core.spec import load_spec

    summary = bench_model(model, load_spec(spec), tracking_uri=tracking_uri, batch_size=batch_size)
    print_summary(summary)


# ---------------------------------------------------------------------------------------------- fetch
@app.command("fetch")
@handle_errors
def fetch(model: str = typer.Argument(..., metavar="MODEL@ALIAS|MODEL/VERSION", help=(
              "Registered model and alias or version, e.g. digits-cnn-optimized@production or "
              "digits-cnn-optimized/3.")),
          output: Path = typer.Option(..., "--output", "-o", help="Folder to write the model file(s) into "
                                                                  "(created)."),
          tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help=(
              "MLflow store holding the registry (default: $MLFLOW_TRACKING_URI, else the local store under "
              "$TAILGUARD_HOME, as `tailguard register` and `report` use)."))) -> None:
    """Download a registered version's model file(s) (the ONNX file and any sidecars, not MLflow's packaging) into
    a folder and print each file with its sha256. Exit 2 for an unknown model, alias or version."""
    from tailguard.fetch import fetch_model

    res = fetch_model(model, output, tracking_uri=tracking_uri)
    variant = res.tags.get(VARIANT_TAG)
    what = f"{res.name} v{res.version}" + (f" (@{res.alias})" if res.alias else "") + (
        f", variant {variant}" if variant else "") + (f", gates {res.tags[GATES_TAG]}"
                                                      if res.tags.get(GATES_TAG) else "")
    console.print(f"fetched {what} from {res.tracking_uri}", markup=False, highlight=False)
    for f in res.files:
        check = "  (= registry's tailguard.sha256)" if f.sha256 == res.registry_sha256 else ""
        console.print(f"  wrote {f.path}  {f.bytes} bytes  sha256 {f.sha256}{check}", markup=False,
                      highlight=False, soft_wrap=True)


# ------------------------------------------------------------------------------------------- register
# register_model names its arguments in errors; the CLI names its options instead.
_REGISTER_FIELDS = {"name": "NAME", "path": "PATH", "format": "--format", "class_path": "--class-path",
                    "init_kwargs": "--init-kwargs", "tags": "--tag", "model_path": "--model-path", "spec": "--spec"}


def _model_dirs(dirs: Optional[list[Path]], option: str) -> list[Path]:
    """--model-path folders, checked to exist (InputError naming `option`)."""
    from tailguard.core.errors import InputError

    out = []
    for d in dirs or []:
        if not d.is_dir():
            raise InputError(f"{option}: not a folder: {d}", hint="the folder that holds the model class's module")
        out.append(d.resolve())
    return out


@app.command("register")
@handle_errors
def register(name: str = typer.Argument(..., help="Registered model name (the spec's model.registered_name)."),
             path: Path = typer.Argument(..., help="Model file: .onnx, .pt2 (torch.export.save), or a state dict "
                                                   "(.pt / .pth / .safetensors)."),
             format: Optional[str] = typer.Option(None, "--format", help=(
                 "onnx | torch-export | state-dict (default: from the suffix: .onnx, .pt2, .pt/.pth/.safetensors).")),
             class_path: Optional[str] = typer.Option(None, "--class-path", help=(
                 "'module:Class' the state dict loads into (state-dict only).")),
             init_kwargs: Optional[str] = typer.Option(None, "--init-kwargs", help=(
                 "JSON object of the class's keyword arguments, e.g. '{\"hidden\": 64}'.")),
             tag: Optional[list[str]] = typer.Option(None, "--tag", help="Version tag KEY=VALUE (repeatable)."),
             model_path: Optional[list[Path]] = typer.Option(None, "--model-path", help=(
                 "Folder to import --class-path's module from (repeatable); the current directory is searched "
                 "too, after the installed packages.")),
             description: Optional[str] = typer.Option(None, "--description", help="Version description."),
             tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help=(
                 "MLflow tracking and registry URI (default: $MLFLOW_TRACKING_URI, else the local store under "
                 "$TAILGUARD_HOME, as `tailguard run` uses for a spec without mlflow.tracking_uri).")),
             experiment: Optional[str] = typer.Option(None, "--experiment", help=(
                 "MLflow experiment of the registering run (default tailguard/model-registration).")),
             spec: Optional[Path] = typer.Option(None, "--spec", help=(
                 "Spec YAML whose model.outputs (dtype, rank, fixed sizes) are checked against the model before "
                 "anything is written (exit 2 on a mismatch).")),
             trusted: bool = typer.Option(False, "--trusted", help=(
                 "The .pt2 comes from a source you control: load it without first refusing an archive that holds "
                 "code (pickled weights or constants, custom objects; docs/deploy.md, Trust model)."))) -> None:
    """Register an FP32 reference model file as a new version of NAME; print the version and its models:/ URI.
    Exit 0 registered, 2 bad input (nothing is written then)."""
    from tailguard.core.errors import InputError
    from tailguard.registration import DEFAULT_EXPERIMENT, parse_init_kwargs, parse_tags, register_model

    try:
        dirs = _model_dirs(model_path, "model_path") + [Path.cwd()]
        reg = register_model(name, path, format=format, class_path=class_path,
                             init_kwargs=parse_init_kwargs(init_kwargs) if init_kwargs is not None else None,
                             tags=parse_tags(tag or []), description=description, tracking_uri=tracking_uri,
                             experiment=experiment or DEFAULT_EXPERIMENT, model_path=dirs, spec=spec,
                             trusted=trusted)
    except InputError as err:
        field, sep, rest = err.message.partition(": ")
        if sep and field in _REGISTER_FIELDS:
            err.message = f"{_REGISTER_FIELDS[field]}: {rest}"
        raise
    console.print(f"registered {reg.name} version {reg.version} ({reg.format}, sha256 {reg.sha256[:12]})", markup=False)
    console.print(f"  uri: {reg.model_uri}", markup=False)
    from tailguard.core.redact import redact_uri

    console.print(f"  tracking: {redact_uri(reg.tracking_uri)}", markup=False)
    if reg.class_file:
        console.print(f"  class {reg.class_path} from {reg.class_file}: a run imports it from an installed "
                      "package, the spec's folder or --model-path")
    console.print(f"  next: set model.registered_name: {reg.name} (version: {reg.version} or latest) in a spec, "
                  "then `tailguard run SPEC`")


# -------------------------------------------------------------------------------------------- compile
@app.command("compile")
@handle_errors
def compile_(spec: Path = typer.Argument(..., help="Spec YAML file."),
             output: Path = typer.Option(..., "--output", "-o", help="KFP IR YAML to write."),
             no_cache: bool = typer.Option(False, "--no-cache", help="KFP execution caching off for every task "
                                                                      "(default: on for export and build-*).")
             ) -> None:
    """Compile SPEC to KFP IR YAML (GPU node-pool settings, images and secrets from the kubeflow section; KFP
    caching on for the pure tasks)."""
    from tailguard.core.spec import load_spec
    from tailguard.pipeline import compile_pipeline

    s = load_spec(spec)
    compile_pipeline(s, str(output), cache=not no_cache)
    console.print(f"wrote {output}")


@app.command("submit")
@handle_errors
def submit_(spec: Path = typer.Argument(..., help="Spec YAML file."),
            host: str = typer.Option(..., "--host", help="KFP API endpoint, e.g. https://kfp.example.com/pipeline"),
            model_version: Optional[str] = typer.Option(None, "--model-version", help="Overrides model.version."),
            experiment: Optional[str] = typer.Option(None, "--experiment", help="KFP experiment name."),
            tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri",
                                                       help="MLflow server the pods use.")) -> None:
    """Submit SPEC to a KFP cluster; re-submitting the same (model, version, spec) returns the existing run."""
    from tailguard.core.spec import load_spec
    from tailguard.submit import submit

    run_id = submit(load_spec(spec), host=host, model_version=model_version, experiment=experiment,
                    tracking_uri=tracking_uri)
    console.print(f"run: {run_id}")


# ---------------------------------------------------------------------------------------------- cache
@cache_app.command("ls")
@handle_errors
def cache_ls(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List the cache's entries, most recently used first: key, step, what, size, last use."""
    import time

    from tailguard.core.cache import cache_dir, entries, max_bytes

    found = entries()
    if as_json:
        sys.stdout.write(json.dumps([e.to_dict() for e in found], indent=2) + "\n")
        return
    total = sum(e.bytes for e in found)
    table = Table(title=f"{cache_dir()}: {len(found)} entries, {total / 1e6:.1f} MB (bound {max_bytes() / 1e6:.0f} MB)")
    for col in ("key", "step", "what", "MB", "last used"):
        table.add_column(col)
    for e in found:
        table.add_row(e.key[:12], e.step, e.label, f"{e.bytes / 1e6:.2f}",
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used)))
    console.print(table)


@cache_app.command("prune")
@handle_errors
def cache_prune(max_bytes_: Optional[int] = typer.Option(None, "--max-bytes", min=0, help=(
        "Keep at most this many bytes (least recently used entries go first); default $TAILGUARD_CACHE_MAX_BYTES "
        "or 5 GiB. 0 empties the cache."))) -> None:
    """Remove least recently used entries down to the size bound, and partial entries of killed processes."""
    from tailguard.core.cache import prune

    removed = prune(max_bytes_)
    console.print(f"removed {len(removed)} entries ({sum(e.bytes for e in removed) / 1e6:.1f} MB)")


# ----------------------------------------------------------------------------------------------- demo
@app.command("demo")
@handle_errors
def demo(skip_monitor: bool = typer.Option(False, "--skip-monitor", help="Skip the monitor replay."),
         n_validation: int = typer.Option(2500, help="Validation rows (WordNet glosses)."),
         n_calibration: int = typer.Option(256, help="Calibration rows.")) -> None:
    """The main job on real input: MiniLM + WordNet, embedded MLflow, local KFP run, monitor replay."""
    from tailguard.demo.run import run_demo

    code = run_demo(console, skip_monitor=skip_monitor, n_validation=n_validation, n_calibration=n_calibration)
    raise typer.Exit(code)


# ------------------------------------------------------------------------------------------- monitor
@monitor_app.command("replay")
@handle_errors
def monitor_replay(spec: Path = typer.Option(..., "--spec", help="Spec YAML (its monitoring section)."),
                   reference: Path = typer.Option(..., "--reference", help="FP32 reference .onnx."),
                   candidate: Path = typer.Option(..., "--candidate", help=(
                       "Candidate (promoted): .onnx, or a torch variant's .pt2 with its manifest beside it.")),
                   requests: Path = typer.Option(..., "--requests", help="Parquet of logged requests."),
                   out: Path = typer.Option(..., "--out", help="Folder for alerts.json and slices.json."),
                   seed: int = typer.Option(0, "--seed", help="Sampler seed (replays are deterministic)."),
                   centroids: Optional[Path] = typer.Option(None, "--centroids", help=(
                       "centroids.npz of the nearest_centroid slices (`topic`), as logged with the variant's "
                       "validate run.")),
                   trusted: bool = typer.Option(False, "--trusted", help=(
                       "A .pt2 candidate comes from a source you control: load it without first refusing an "
                       "archive that holds code (docs/deploy.md, Trust model)."))) -> None:
    """Replay logged requests through the monitor offline. Exit 0 no alert, 4 alert(s) fired, 2 bad input."""
    from tailguard.monitoring.replay import replay_cli

    # one line per alert, then a table (monitoring/replay.py print_replay); the same-file warning on stderr
    code = replay_cli(spec, reference, candidate, requests, out, seed=seed, console=console, err_console=err_console,
                      centroids=centroids, trusted=trusted)
    raise typer.Exit(code)


@monitor_app.command("serve")
@handle_errors
def monitor_serve(spec: Path = typer.Option(..., "--spec", help="Spec YAML (its monitoring section)."),
                  reference: Optional[Path] = typer.Option(None, "--reference", help="FP32 reference .onnx."),
                  candidate: Optional[Path] = typer.Option(None, "--candidate", help=(
                      "Candidate: .onnx, or a torch variant's .pt2 with its manifest beside it (omit: pairs-only "
                      "monitor).")),
                  host: str = typer.Option("127.0.0.1", "--host", help="Bind address."),
                  port: int = typer.Option(8080, "--port", min=0, max=65535, help=(
                      "Port (0: one the kernel chooses, logged as 'HTTP ingest on HOST:PORT').")),
                  evidence_only: bool = typer.Option(False, "--evidence-only", help=(
                      "Run as a replica: measure and export evidence at /v1/evidence for a combiner; never alert.")),
                  peer: Optional[list[str]] = typer.Option(None, "--peer", help=(
                      "Base URL of a replica (repeatable): this process combines their evidence with its own and is "
                      "the deployment's only alerting process (docs/monitor.md, Replicas).")),
                  poll_interval: float = typer.Option(5.0, "--poll-interval", min=0.1,
                                                      help="Seconds between reads of the peers' evidence."),
                  peer_dns: Optional[list[str]] = typer.Option(None, "--peer-dns", help=(
                      "NAME:PORT of a headless Service (clusterIP: None) whose DNS records list the replicas "
                      "(repeatable): looked up at every poll, each address one peer; with or instead of --peer "
                      "(docs/monitor.md, Replicas).")),
                  peer_wait_polls: int = typer.Option(12, "--peer-wait-polls", min=0, help=(
                      "With --peer / --peer-dns: polls to wait for a replica that cannot be read before merging the "
                      "others' newer evidence without it (its backlog then merges late); longer waits keep a late "
                      "replica's evidence in order, and delay every alert meanwhile.")),
                  expect_replicas: Optional[int] = typer.Option(None, "--expect-replicas", min=1, help=(
                      "With --peer: the number of replica processes the deployment runs; while fewer answer (or a "
                      "--peer URL answers from several processes) /readyz is not ready and "
                      "tailguard_monitor_incomplete_polls_total counts the polls (docs/monitor.md, Replicas).")),
                  grpc_port: Optional[int] = typer.Option(None, "--grpc-port", min=0, max=65535, help=(
                      "Also accept the Open Inference Protocol over gRPC (inference.GRPCInferenceService: "
                      "ModelInfer, ServerLive/Ready, ModelReady, metadata) on this port, feeding the same "
                      "sampling, queue, limits and metrics as HTTP (endpoint=\"grpc\").")),
                  auth_token_file: Optional[Path] = typer.Option(None, "--auth-token-file", help=(
                      "File holding the bearer token every endpoint but /healthz requires (a mounted Secret; "
                      "overrides monitoring.auth_token_file / auth_token_env; docs/deploy.md, Monitor trust "
                      "model).")),
                  candidate_version: Optional[str] = typer.Option(None, "--candidate-version", help=(
                      "The candidate's registry version (NAME@ALIAS, NAME/VERSION or models:/...): at start the "
                      "monitor compares its node with the nodes that version was validated on (tag "
                      "tailguard.validated_on); a mismatch shows in /readyz node_mismatch and the "
                      "tailguard_monitor_node_mismatch gauge (docs/deploy.md).")),
                  tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help=(
                      "MLflow registry for --candidate-version (default: $MLFLOW_TRACKING_URI).")),
                  centroids: Optional[Path] = typer.Option(None, "--centroids", help=(
                      "centroids.npz of the nearest_centroid slices (`topic`), as logged with the variant's "
                      "validate run (default: read from --candidate-version's run).")),
                  trusted: bool = typer.Option(False, "--trusted", help=(
                      "A .pt2 candidate comes from a source you control: load it without first refusing an "
                      "archive that holds code (pickled weights or constants, custom objects, an AOTInductor "
                      "package's native code; docs/deploy.md, Trust model).")),
                  probe_port: Optional[int] = typer.Option(None, "--probe-port", min=0, max=65535, help=(
                      "Also serve /healthz, /readyz and /metrics on this port, from a server the ingest port's "
                      "connections cannot starve (point kubelet probes and Prometheus here; default "
                      "monitoring.probe_port, 8082; 0: off)."))) -> None:
    """The shadow monitor HTTP service: OIP ingest (JSON or binary tensor data extension; gRPC with --grpc-port),
    /metrics, /healthz, /readyz, /v1/slices, /v1/evidence."""
    from tailguard.monitoring.replay import same_file_warning
    from tailguard.monitoring.serve import serve

    if reference is not None and (warning := same_file_warning(reference, candidate)) is not None:
        from rich.text import Text

        err_console.print(Text.assemble(("warning", "bold yellow"), ": ", warning), soft_wrap=True)
    serve(spec, reference, candidate, host, port, evidence_only=evidence_only, peers=list(peer or []),
          poll_interval_s=poll_interval, grpc_port=grpc_port, auth_token_file=auth_token_file,
          expect_replicas=expect_replicas, peer_dns=list(peer_dns or []), peer_wait_polls=peer_wait_polls,
          candidate_version=candidate_version, tracking_uri=tracking_uri, centroids=centroids, trusted=trusted,
          probe_port=probe_port)


# ------------------------------------------------------------------------------------------- trigger
@trigger_app.command("serve")
@handle_errors
def trigger_serve(config: Path = typer.Option(..., "--config", help="Trigger config YAML (models -> specs)."),
                  host: str = typer.Option("127.0.0.1", "--host", help="Bind address."),
                  port: int = typer.Option(8080, "--port", help="Port.")) -> None:
    """Receive MLflow model_version.created webhooks (HMAC-SHA256 checked) and start runs."""
    from tailguard.trigger import serve

    serve(config, host, port)


def main() -> None:
    """Console-script entry point. The process' objects are frozen for the garbage collector before it exits
    (`tailguard.core.taskio.freeze_for_exit`: the interpreter's final collection skips them)."""
    from tailguard.core.taskio import freeze_for_exit

    try:
        app()
    finally:
        freeze_for_exit()


if __name__ == "__main__":
    main()
