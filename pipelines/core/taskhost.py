"""The local task host: a warm interpreter that a local run's task bodies are forked from.

Every kfp.local task is its own Python process (`python -m kfp.dsl.executor_main`), and each imported mlflow with
its SQLAlchemy store, onnxruntime, pandas, scipy, torch, Great Expectations... again: 44 s of the demo's 195 s of
task time, measured per task by `task_entry`'s import clock (benchmarks/results/demo.json at 32cf1de). During a
local run (`tailguard.runner.run_local`) one host process imports them once (`PRELOAD`), and each task's body
runs in a process forked from it: the task's own process (kfp.local's subprocess, the "stub") sends its
arguments, environment, working folder, `sys.path`, `sys.argv` and its stdin / stdout / stderr file descriptors
(SCM_RIGHTS) over a Unix socket; the host forks a child that takes them over, runs the body (the whole
`task_entry` wrapper: error markers and timing line come from the child, into the task's own log), and writes the
result; the stub returns it, with the metadata the body set on KFP output artifacts (`Output[Metrics]`), to the
KFP executor, which writes the task's outputs as usual. Each task still runs in a fresh process of its own
(nothing is shared between tasks but the imported modules, copy-on-write), with the stub's exit code: the body's
`SystemExit` code, 1 when it raised.

Where the host is not used, the body runs in the stub's own process as before (`call_in_host` returns
NOT_HOSTED): on a cluster (no TAILGUARD_TASK_HOST in the pod), off Linux, with TAILGUARD_TASK_HOST=0, when the
host cannot be reached or refuses before forking, when the arguments do not pickle, and when an environment
variable that libraries read once at load time (`LOAD_TIME_ENV`: OpenMP / BLAS threads, PYTHON*, LD_*, HF_*, ...)
differs between the stub and the host (the host checks and refuses), since the host's value would silently win.

Lifetimes: the runner creates the listening socket (so a task never races the host's start) and a pipe whose end
it keeps; the host exits when that pipe closes (the runner ended, even by SIGKILL) or on SIGTERM, and then kills
its children. A child runs in its own process group; when its stub goes away (the runner stopping the run
terminates the stubs) the host sends SIGTERM to that group. SIGINT is left to the runner, which stops every
process it started (`runner._stop_children`).

Protocol (one connection per task): stub -> host `MAGIC` + payload length (8 bytes, big-endian) with the three
file descriptors, then the pickled request; host -> stub b"R" + 8 bytes when it refuses (the request's
load-time environment differs from the one the host imported its libraries with: the stub runs the body itself),
b"S" + child pid (8 bytes) once forked, b"E" + the wait status as `os.waitstatus_to_exitcode` gives it (8 bytes,
signed: -N when killed by signal N) when it ended. The socket lives in the run's folder, the stub's result file in
the run's TMPDIR (mode 0600); nothing of the environment is written to disk.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

ENV_TASK_HOST = "TAILGUARD_TASK_HOST"  # the host's socket path during a local run; "0" / "off" turns hosting off
MAGIC = b"TGH1"
NOT_HOSTED = object()  # call_in_host's answer when the body must run in this process

# Libraries (and kernel modules) every local task imports some of, roughly in the order the pipeline's tasks first
# need them (check-data, resolve, export, builds, reference-pass, validate); the runner adds the task modules
# themselves (`task_host(preload=)`: the kernel names nothing above it). Importing them once is the point of the host:
# 7.1 s in one process here (torch 1.7, Great Expectations 1.7, mlflow + its SQLAlchemy store 1.5, scipy.stats 0.5,
# transformers 0.5, pandas 0.3), plus 2.6 s for what the demo's tasks still imported in their bodies after those
# (sys.modules before and after each body: sympy and torch._dynamo for the torch export and torch variants,
# transformers.modeling_utils, matplotlib.pyplot and GitPython for MLflow's runs). A missing module is skipped.
PRELOAD = (
    "numpy", "pandas", "pyarrow.parquet", "yaml", "pydantic", "tailguard.core.spec", "great_expectations",
    "sqlalchemy", "mlflow", "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store", "git",
    "tailguard.core.tracking", "tailguard.core.reference", "torch", "onnx", "onnxruntime", "transformers",
    "transformers.modeling_utils", "torch.onnx", "sympy", "torch._dynamo", "onnxruntime.quantization",
    "onnxruntime.transformers.optimizer", "scipy.special", "scipy.stats", "networkx", "tailguard.core.runtime",
    "tailguard.core.latency", "tailguard.core.cache", "mlflow.onnx", "mlflow.pyfunc", "matplotlib.pyplot", "psutil",
    "jinja2",
)
# Environment variables that libraries read once, when they are loaded (libgomp, OpenBLAS, MKL, the interpreter,
# the dynamic linker, huggingface_hub / transformers constants, MLflow's and GX's import-time switches, the locale):
# a task whose value differs from the host's runs in its own process.
LOAD_TIME_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "LD_", "PYTHON", "CUDA_", "NVIDIA_",
                 "TORCH", "PYTORCH_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "ORT_", "MLFLOW_", "GX_",
                 "DO_NOT_TRACK", "TZ", "LANG", "LC_")

_in_child = False  # set in a forked child: its task body runs here, not in yet another host


# ------------------------------------------------------------------------------------------------ the stub side
def call_in_host(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run `fn(*args, **kwargs)` in a child of the task host and return its result, or NOT_HOSTED.

    Args:
        fn: a module-level function (found again in the child by `fn.__module__` and `fn.__qualname__`).
        args, kwargs: its arguments (pickled; KFP artifacts included).

    Returns:
        fn's return value; KFP artifacts among the arguments get the metadata the body set on them. NOT_HOSTED
        when the body must run in this process (see the module docstring: no host, not Linux, a function not
        importable by name, arguments that do not pickle, a load-time environment variable that differs, a host
        that refused or vanished before it forked).

    Raises:
        SystemExit: the body ended with a non-zero exit code (it raised: 1, its traceback already in the task's
            log; SystemExit(n): n) or the child was killed (128 + the signal); nothing to do but exit with it.
    """
    path = os.environ.get(ENV_TASK_HOST, "")
    if _in_child or not path or path.lower() in ("0", "off", "false", "no") or not sys.platform.startswith("linux"):
        return NOT_HOSTED
    if "<locals>" in fn.__qualname__ or fn.__module__ in ("__main__", "ephemeral_component"):
        return NOT_HOSTED  # a child could not find it again by name
    fd, result_path = tempfile.mkstemp(prefix="tailguard-task-", suffix=".pickle")
    os.close(fd)
    try:
        request = {"target": f"{fn.__module__}:{fn.__qualname__}", "args": args, "kwargs": kwargs,
                   "env": dict(os.environ), "cwd": os.getcwd(), "argv": list(sys.argv), "path": list(sys.path),
                   "result": result_path}
        try:
            payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - an argument that does not pickle: run here
            return NOT_HOSTED
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            socket.send_fds(conn, [MAGIC + struct.pack(">Q", len(payload))], [0, 1, 2])
            conn.sendall(payload)
            started = _recv_exact(conn, 9)
        except OSError:
            return NOT_HOSTED
        if started[:1] != b"S":  # refused (another load-time environment) or gone before it forked
            conn.close()
            return NOT_HOSTED
        with conn:
            try:
                ended = _recv_exact(conn, 9)
            except OSError:
                ended = b""
        if ended[:1] != b"E":
            print(f"tailguard task host: the task's process (pid {struct.unpack('>q', started[1:])[0]}) ended "
                  "without a status (the host stopped)", file=sys.stderr, flush=True)
            raise SystemExit(1)
        code = struct.unpack(">q", ended[1:])[0]
        if code < 0:
            print(f"tailguard task host: the task's process was killed by signal {-code}", file=sys.stderr,
                  flush=True)
            raise SystemExit(128 - code)
        if code != 0:
            raise SystemExit(code)
        with open(result_path, "rb") as f:
            result = pickle.load(f)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(result_path)
    _set_metadata(args, kwargs, result["metadata"])
    return result["value"]


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def _load_time_env(env: Any) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_ENV)}


def _artifacts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments with a `metadata` dict (KFP artifacts), by position ("0") or name."""
    items = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
    return {k: v for k, v in items if isinstance(getattr(v, "metadata", None), dict)}


def _set_metadata(args: tuple[Any, ...], kwargs: dict[str, Any], metadata: dict[str, dict[str, Any]]) -> None:
    for key, artifact in _artifacts(args, kwargs).items():
        if key in metadata:
            artifact.metadata.clear()
            artifact.metadata.update(metadata[key])


# ------------------------------------------------------------------------------------------------ the runner side
@contextlib.contextmanager
def task_host(run_dir: Path, preload: Sequence[str] = PRELOAD) -> Iterator[str | None]:
    """Start a task host for the tasks of one local run, and stop it when the block ends.

    Sets $TAILGUARD_TASK_HOST to its socket for the block (the tasks inherit it) and restores it after. Does
    nothing (yields None) when $TAILGUARD_TASK_HOST is already set (an enclosing run's host, or "0" to turn it off)
    or off Linux.

    Args:
        run_dir: the run's folder; the socket is `<run_dir>/task-host.sock` (a path under 108 bytes is needed:
            a longer one falls back to a private folder under the system's temporary directory).
        preload: the modules the host imports, in this order, between requests (a missing one is skipped).

    Yields:
        The socket path, or None.
    """
    if os.environ.get(ENV_TASK_HOST) or not sys.platform.startswith("linux") or not hasattr(socket, "send_fds"):
        yield None
        return
    folder = None
    path = str(Path(run_dir) / "task-host.sock")
    if len(path.encode()) > 100:
        folder = tempfile.mkdtemp(prefix="tailguard-host-")
        path = str(Path(folder) / "task-host.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    alive_r, alive_w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "tailguard.core.taskhost", str(listener.fileno()), str(alive_r),
                             *preload],
                            pass_fds=(listener.fileno(), alive_r), stdin=subprocess.DEVNULL)
    listener.close()
    os.close(alive_r)
    os.environ[ENV_TASK_HOST] = path
    try:
        yield path
    finally:
        os.environ.pop(ENV_TASK_HOST, None)
        os.close(alive_w)  # the host sees the pipe close, stops its children and exits
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(path)
        if folder:
            with contextlib.suppress(OSError):
                os.rmdir(folder)


# ------------------------------------------------------------------------------------------------ the host
class _Child:
    """What a forked child runs once it has left the host's loop: the request's function, then exit."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request

    def run(self) -> int:
        global _in_child
        _in_child = True
        req = self.request
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv[:] = req["argv"]
        # the stub's import path, then what the host's imports appended to the host's (onnxruntime.transformers
        # puts its own folder there at import and imports its siblings by their top-level names later)
        sys.path[:] = req["path"] + [p for p in sys.path if p not in req["path"]]
        if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS, so do we
            sys.modules["numpy"].random.seed()
        try:
            module, qualname = req["target"].split(":")
            fn: Any = importlib.import_module(module)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            value = fn(*req["args"], **req["kwargs"])
            tmp = req["result"] + ".tmp"
            with open(tmp, "wb") as f:
                pickle.dump({"value": value, "metadata": {k: dict(a.metadata) for k, a in
                                                          _artifacts(req["args"], req["kwargs"]).items()}}, f,
                            protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, req["result"])
            return 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                return int(exc.code or 0)
            print(exc.code, file=sys.stderr)
            return 1
        except BaseException:  # noqa: BLE001 - as an uncaught exception would: traceback to stderr, exit 1
            traceback.print_exc()
            return 1


def serve(listener_fd: int, alive_fd: int, preload: Sequence[str] = PRELOAD) -> _Child | None:
    """The host's loop: fork a child per request until the runner's pipe closes, importing `preload` meanwhile.

    The modules are imported one at a time while no request waits, so a task that arrives early is forked at
    once and imports what is not loaded yet itself, while the host goes on with the rest on another core (a task
    never waits for the whole preload).

    Returns:
        In a forked child, the `_Child` to run (the loop's frames are left behind); in the host, None when it
        stops.
    """
    import gc

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner stops the run and its processes (_stop_children)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # The runner's environment as it is (run_local quieted it before starting the host): what the preloaded
    # libraries read, and what each request must match
    loaded_with = _load_time_env(os.environ)
    pending = list(preload)
    listener = socket.socket(fileno=listener_fd)
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    poller.register(alive_fd, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    children: dict[int, socket.socket] = {}  # pid -> its stub's connection
    by_fd: dict[int, int] = {}  # connection fd -> pid
    try:
        while not stopping:
            events = poller.poll(0 if pending else 1000)
            for fd, _ev in events:
                if fd == alive_fd:
                    stopping.append(1)
                elif fd == wake_r:
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        os.read(wake_r, 4096)
                elif fd == listener_fd:
                    child = _accept(listener, children, by_fd, poller, (listener, alive_fd, wake_r, wake_w),
                                    loaded_with)
                    if child is not None:
                        return child
                elif fd in by_fd:  # the stub closed its end: nobody waits for the task any more
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(by_fd[fd], signal.SIGTERM)
                    poller.unregister(fd)
            _reap(children, by_fd, poller)
            if pending and not events and not stopping:
                with contextlib.suppress(Exception):
                    importlib.import_module(pending.pop(0))
                if not pending:
                    gc.collect()
                    gc.freeze()  # the children do not copy the preloaded objects' pages when their collector runs
    finally:
        if not _in_child:
            for pid in children:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            for pid in list(children):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
    return None


def _accept(listener: socket.socket, children: dict[int, socket.socket], by_fd: dict[int, int], poller: Any,
            own: tuple[Any, ...], loaded_with: dict[str, str]) -> _Child | None:
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        conn.settimeout(60)
        msg, fds, _flags, _addr = socket.recv_fds(conn, 12, 3)
        while len(msg) < 12:
            more = conn.recv(12 - len(msg))
            if not more:
                raise OSError("short header")
            msg += more
        if msg[:4] != MAGIC or len(fds) != 3:
            raise OSError("not a task request")
        size = struct.unpack(">Q", msg[4:])[0]
        request = pickle.loads(_recv_exact(conn, size))
        conn.settimeout(None)
        if _load_time_env(request["env"]) != loaded_with:  # the host's libraries were loaded with other values
            conn.sendall(b"R" + struct.pack(">q", 0))
            raise OSError("load-time environment differs")
    except Exception:  # noqa: BLE001 - a refused, bad or vanished stub: it runs its task itself (nothing forked)
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:  # the child: its own process group, the stub's stdio, none of the host's descriptors
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for c in children.values():
            c.close()
        conn.close()
        listener.close()
        for fd in own[1:]:
            with contextlib.suppress(OSError):
                os.close(fd)
        return _Child(request)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.setpgid(pid, pid)  # also set in the child: whichever runs first
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    by_fd[conn.fileno()] = pid
    poller.register(conn, select.POLLIN | select.POLLHUP)
    with contextlib.suppress(OSError):
        conn.sendall(b"S" + struct.pack(">q", pid))
    return None


def _reap(children: dict[int, socket.socket], by_fd: dict[int, int], poller: Any) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        by_fd.pop(conn.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            poller.unregister(conn)
        with contextlib.suppress(OSError):
            conn.sendall(b"E" + struct.pack(">q", os.waitstatus_to_exitcode(status)))
        conn.close()


def main(argv: list[str]) -> int:
    """`python -m tailguard.core.taskhost LISTENER_FD ALIVE_FD [MODULE ...]` (started by `task_host`)."""
    child = serve(int(argv[0]), int(argv[1]), argv[2:])
    if child is None:
        return 0
    code = child.run()
    # The interpreter's Python-level exit (non-daemon threads joined, atexit callbacks, stdio flushed), then
    # os._exit: C++ static destructors of libraries whose helper threads were started in the host (and do not
    # exist in this child) abort the process at exit() ("std::system_error: No such process", seen here).
    import atexit
    import threading

    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":  # run the imported module's main, so that _in_child is the one task_entry reads
    from tailguard.core.taskhost import main as _main

    sys.exit(_main(sys.argv[1:]))
