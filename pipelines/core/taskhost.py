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
terminates the stubs) the host sends SIGTERM to that group. A child dies with the host (PR_SET_PDEATHSIG:
SIGKILL), and a stub whose host vanished before the status kills its child's process group (the body's own
subprocesses included), so a SIGKILLed host leaves no orphans. SIGINT is left to the runner, which stops every
process it started (`runner._stop_children`).

Who may ask: the socket is mode 0600 in the run's folder; the host reads nothing from a connection whose peer
(SO_PEERCRED) is another user, and decodes nothing before the request's first 48 bytes carried the run's secret
token, which only the runner's tasks have (`TAILGUARD_TASK_HOST_TOKEN` in their environment, 32 random bytes per
run; not on disk, not on a command line). The request is JSON and bytes: the host never unpickles anything; the
task's arguments (pickled by the stub, KFP artifacts included) are unpickled in the forked child, the task's own
process. Connections are read concurrently, without blocking the host's loop, and a request must arrive whole
within `REQUEST_DEADLINE_S` of its connection (a total, not per read: a client sending a byte at a time is closed
at the deadline too), so an idle or slow client never delays another task.

Protocol (one connection per task): stub -> host a 48-byte header (`_HEADER`: `MAGIC`, the token, the JSON
envelope's length, the pickled arguments' length) with the three file descriptors, then the envelope (UTF-8 JSON:
target, env, cwd, argv, path, result) and the arguments; host -> stub b"R" + 8 bytes when it refuses a well-formed
request (the request's load-time environment differs from the one the host imported its libraries with: the stub
runs the body itself), b"S" + child pid (8 bytes) once forked, b"E" + the wait status as
`os.waitstatus_to_exitcode` gives it (8 bytes, signed: -N when killed by signal N) when it ended; a connection
refused for its peer, token, shape or deadline is closed without an answer (the stub runs the body itself). The
socket lives in the run's folder, the stub's result file in the run's TMPDIR (mode 0600); nothing of the
environment is written to disk.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import json
import os
import pickle
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

ENV_TASK_HOST = "TAILGUARD_TASK_HOST"  # the host's socket path during a local run; "0" / "off" turns hosting off
ENV_TASK_HOST_TOKEN = "TAILGUARD_TASK_HOST_TOKEN"  # the run's secret (64 hex digits) its tasks present to the host
MAGIC = b"TGH2"
NOT_HOSTED = object()  # call_in_host's answer when the body must run in this process
# The request's header: MAGIC, the token's 32 bytes, the JSON envelope's length, the pickled arguments' length
_HEADER = struct.Struct(">4s32sIQ")
TOKEN_BYTES = 32
# Seconds from a connection's accept by which its whole request must have arrived (a stub sends it at once: a few
# KB of environment and the arguments); after it the host closes the connection, and the stub, if it was one, runs
# its body itself. Generous for a loaded machine, short against a client that holds a connection open.
REQUEST_DEADLINE_S = 30.0
MAX_ENVELOPE_BYTES = 16 << 20  # the JSON envelope (environment, sys.path, argv): a few KB in practice
MAX_ARGS_BYTES = 256 << 20  # the pickled arguments (strings and KFP artifacts: a few KB in practice)
MAX_INCOMING = 256  # connections whose request is still arriving; one more is closed at once
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

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

_in_child = False  # set in a forked child (the first thing it does): its task body runs here, not in another host


# ------------------------------------------------------------------------------------------------ the stub side
def call_in_host(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run `fn(*args, **kwargs)` in a child of the task host and return its result, or NOT_HOSTED.

    Args:
        fn: a module-level function (found again in the child by `fn.__module__` and `fn.__qualname__`).
        args, kwargs: its arguments (pickled; KFP artifacts included; unpickled in the child only).

    Returns:
        fn's return value; KFP artifacts among the arguments get the metadata the body set on them. NOT_HOSTED
        when the body must run in this process (see the module docstring: no host or no token, not Linux, a
        function not importable by name, arguments that do not pickle, a load-time environment variable that
        differs, a host that refused or vanished before it forked).

    Raises:
        SystemExit: the body ended with a non-zero exit code (it raised: 1, its traceback already in the task's
            log; SystemExit(n): n), the child was killed (128 + the signal), or the host vanished before the
            child's status came (1; the child's process group is killed first); nothing to do but exit with it.
    """
    path = os.environ.get(ENV_TASK_HOST, "")
    if _in_child or not path or path.lower() in ("0", "off", "false", "no") or not sys.platform.startswith("linux"):
        return NOT_HOSTED
    if "<locals>" in fn.__qualname__ or fn.__module__ in ("__main__", "ephemeral_component"):
        return NOT_HOSTED  # a child could not find it again by name
    try:
        token = bytes.fromhex(os.environ.get(ENV_TASK_HOST_TOKEN, ""))
    except ValueError:
        token = b""
    if len(token) != TOKEN_BYTES:
        return NOT_HOSTED  # not a task of the run that started the host
    fd, result_path = tempfile.mkstemp(prefix="tailguard-task-", suffix=".pickle")
    os.close(fd)
    try:
        try:
            envelope = json.dumps({"target": f"{fn.__module__}:{fn.__qualname__}", "env": dict(os.environ),
                                   "cwd": os.getcwd(), "argv": list(sys.argv), "path": list(sys.path),
                                   "result": result_path}).encode()
            arguments = pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - an argument that does not pickle (or a path that is not text): run here
            return NOT_HOSTED
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            socket.send_fds(conn, [_HEADER.pack(MAGIC, token, len(envelope), len(arguments))], [0, 1, 2])
            conn.sendall(envelope)
            conn.sendall(arguments)
            started = _recv_exact(conn, 9)
        except OSError:
            return NOT_HOSTED
        if started[:1] != b"S":  # refused (another load-time environment, a deadline) or gone before it forked
            conn.close()
            return NOT_HOSTED
        child = struct.unpack(">q", started[1:])[0]
        with conn:
            try:
                ended = _recv_exact(conn, 9)
            except OSError:
                ended = b""
        if ended[:1] != b"E":
            # The host was killed: its child died with it (PR_SET_PDEATHSIG); what the body started is in the
            # child's process group (pid = pgid: the group lives while a member does, so the id is not reused)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child, signal.SIGKILL)
            print(f"tailguard task host: the task's process (pid {child}) ended without a status (the host "
                  "stopped); its process group was killed", file=sys.stderr, flush=True)
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
def task_host(run_dir: Path, preload: Sequence[str] = PRELOAD, *,
              request_deadline_s: float = REQUEST_DEADLINE_S) -> Iterator[str | None]:
    """Start a task host for the tasks of one local run, and stop it when the block ends.

    Sets $TAILGUARD_TASK_HOST to its socket and $TAILGUARD_TASK_HOST_TOKEN to a fresh secret for the block (the
    tasks inherit both) and removes them after. Does nothing (yields None) when $TAILGUARD_TASK_HOST is already
    set (an enclosing run's host, or "0" to turn it off) or off Linux.

    Args:
        run_dir: the run's folder; the socket is `<run_dir>/task-host.sock` (a path under 108 bytes is needed:
            a longer one falls back to a private folder under the system's temporary directory).
        preload: the modules the host imports, in this order, between requests (a missing one is skipped).
        request_deadline_s: seconds from a connection's accept by which its whole request must have arrived
            (`REQUEST_DEADLINE_S`); the host closes it after.

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
    token = secrets.token_hex(TOKEN_BYTES)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(socket.SOMAXCONN)
    alive_r, alive_w = os.pipe()
    # The token reaches the host in its environment (readable by its user only, unlike a command line)
    proc = subprocess.Popen([sys.executable, "-m", "tailguard.core.taskhost", f"--deadline={request_deadline_s}",
                             str(listener.fileno()), str(alive_r), *preload],
                            pass_fds=(listener.fileno(), alive_r), stdin=subprocess.DEVNULL,
                            env={**os.environ, ENV_TASK_HOST_TOKEN: token})
    listener.close()
    os.close(alive_r)
    os.environ[ENV_TASK_HOST] = path
    os.environ[ENV_TASK_HOST_TOKEN] = token
    try:
        yield path
    finally:
        os.environ.pop(ENV_TASK_HOST, None)
        os.environ.pop(ENV_TASK_HOST_TOKEN, None)
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
def peer_refusal(pid: int, uid: int, gid: int, host_uid: int) -> str | None:
    """Why the host refuses a connection from this peer before reading from it, or None to accept it.

    Args:
        pid, uid, gid: the peer's credentials as SO_PEERCRED gives them (at its connect).
        host_uid: the host's own real user id (`os.getuid()`).

    Returns:
        A one-line reason (another user), or None (the same user: its request must still carry the run's token).
    """
    if uid != host_uid:
        return f"a connection from pid {pid} of uid {uid} (the run's user is uid {host_uid})"
    return None


class _Incoming:
    """A connection whose request is still arriving: what came so far, the descriptors, its deadline."""

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        self.conn = conn
        self.deadline = deadline
        self.buf = bytearray()
        self.fds: list[int] = []
        self.sizes: tuple[int, int] | None = None  # (envelope, arguments) once the header is in

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self.conn.close()


class _Refused(Exception):
    """A request the host does not run (the message says why)."""


class _Child:
    """What a forked child runs once it has left the host's loop: the request's function, then exit."""

    def __init__(self, request: dict[str, Any], arguments: bytes) -> None:
        self.request = request
        self.arguments = arguments

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
            # the arguments are unpickled here, in the task's own process, never in the host
            args, kwargs = pickle.loads(self.arguments)
            self.arguments = b""
            value = fn(*args, **kwargs)
            tmp = req["result"] + ".tmp"
            with open(tmp, "wb") as f:
                pickle.dump({"value": value, "metadata": {k: dict(a.metadata) for k, a in
                                                          _artifacts(args, kwargs).items()}}, f,
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


def _valid_envelope(request: Any) -> bool:
    """The JSON envelope's shape: every field present, of its type (strings, a string map, string lists)."""
    if not isinstance(request, dict) or set(request) != {"target", "env", "cwd", "argv", "path", "result"}:
        return False
    strings = all(isinstance(request[k], str) for k in ("target", "cwd", "result"))
    lists = all(isinstance(request[k], list) and all(isinstance(v, str) for v in request[k]) for k in ("argv", "path"))
    env = isinstance(request["env"], dict) and all(isinstance(v, str) for v in request["env"].values())
    return strings and lists and env and request["target"].count(":") == 1


class _Host:
    """The host's state: its listener, the connections still arriving, its running children."""

    def __init__(self, listener_fd: int, alive_fd: int, token: bytes, deadline_s: float) -> None:
        import ctypes

        self.pid = os.getpid()
        self.uid = os.getuid()
        self.token = token
        self.deadline_s = deadline_s
        self.alive_fd = alive_fd
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.listener = socket.socket(fileno=listener_fd)
        self.listener.setblocking(False)
        self.poller = select.poll()
        for fd in (self.listener.fileno(), alive_fd, self.wake_r):
            self.poller.register(fd, select.POLLIN)
        self.incoming: dict[int, _Incoming] = {}  # connection fd -> its request so far
        self.children: dict[int, socket.socket] = {}  # pid -> its stub's connection
        self.by_fd: dict[int, int] = {}  # connection fd -> pid
        # The runner's environment as it is (run_local quieted it before starting the host): what the preloaded
        # libraries read, and what each request must match
        self.loaded_with = _load_time_env(os.environ)
        try:  # loaded here: a child calls prctl before anything else, importing nothing
            self.prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            self.prctl = None

    def say(self, message: str) -> None:
        with contextlib.suppress(Exception):
            print(f"tailguard task host: {message}", file=sys.stderr, flush=True)

    def timeout_ms(self, importing: bool) -> int:
        wait = 0 if importing else 1000
        if self.incoming:
            soonest = min(inc.deadline for inc in self.incoming.values())
            wait = min(wait, max(0, int((soonest - time.monotonic()) * 1000) + 1))
        return wait

    def accept(self) -> None:
        """Accept every connection waiting; one from another user is closed before anything is read."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the stub waits, or runs its body itself
                self.say(f"could not accept a connection: {exc}")
                return
            try:
                pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                    struct.calcsize("3i")))
            except OSError as exc:
                self.say(f"refused a connection whose peer is unknown ({exc})")
                conn.close()
                continue
            reason = peer_refusal(pid, uid, gid, self.uid)
            if reason is None and len(self.incoming) >= MAX_INCOMING:
                reason = f"a connection from pid {pid}: {MAX_INCOMING} requests are arriving already"
            if reason is not None:
                self.say(f"refused {reason}")
                conn.close()
                continue
            conn.setblocking(False)
            self.incoming[conn.fileno()] = _Incoming(conn, time.monotonic() + self.deadline_s)
            self.poller.register(conn, select.POLLIN)

    def read(self, fd: int) -> _Child | None:
        """Read what has arrived on an incoming connection; fork its child once the request is whole."""
        inc = self.incoming[fd]
        try:
            while True:
                done = self._receive(inc)
                if done is None:  # nothing more there now
                    return None
                if done:
                    return self.start(fd)
        except _Refused as exc:
            self.say(f"refused a request: {exc}")
            self.drop(fd)
            return None

    def _receive(self, inc: _Incoming) -> bool | None:
        """Take one read's worth (never past the request's end): True once the whole request is in, False when
        more is to come, None when the socket holds nothing now.

        Raises:
            _Refused: the peer closed, a bad header (magic, token, sizes), or descriptors other than three.
        """
        if inc.sizes is None:
            want = _HEADER.size - len(inc.buf)
        else:
            want = min(sum(inc.sizes) - len(inc.buf), 1 << 20)
        try:
            if inc.sizes is None:  # the descriptors come with the header's bytes
                data, fds, flags, _ = socket.recv_fds(inc.conn, want, 3)
                inc.fds.extend(fds)
                if flags & socket.MSG_CTRUNC or len(inc.fds) > 3:
                    raise _Refused("more than three file descriptors")
            else:
                data = inc.conn.recv(want)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            raise _Refused(f"the connection failed ({exc})") from None
        if not data:
            raise _Refused("the client closed the connection before its request was whole")
        inc.buf += data
        if inc.sizes is None and len(inc.buf) == _HEADER.size:
            magic, token, n_envelope, n_arguments = _HEADER.unpack(bytes(inc.buf))
            if magic != MAGIC:
                raise _Refused("not a task request (wrong magic)")
            if not hmac.compare_digest(token, self.token):
                raise _Refused("not from a task of this run (wrong token)")
            if n_envelope > MAX_ENVELOPE_BYTES or n_arguments > MAX_ARGS_BYTES:
                raise _Refused(f"too large ({n_envelope} + {n_arguments} bytes)")
            inc.sizes = (n_envelope, n_arguments)
            inc.buf = bytearray()
        return inc.sizes is not None and len(inc.buf) == sum(inc.sizes)

    def expire(self) -> None:
        now = time.monotonic()
        for fd in [fd for fd, inc in self.incoming.items() if inc.deadline <= now]:
            self.say(f"closed a connection whose request did not arrive within {self.deadline_s:g} s")
            self.drop(fd)

    def drop(self, fd: int) -> None:
        inc = self.incoming.pop(fd)
        with contextlib.suppress(KeyError, ValueError):
            self.poller.unregister(fd)
        inc.close()

    def start(self, fd: int) -> _Child | None:
        """Fork the child for a whole request (or refuse it). Returns the `_Child` in the child, None here."""
        inc = self.incoming[fd]
        assert inc.sizes is not None
        n_envelope = inc.sizes[0]
        try:
            request = json.loads(bytes(inc.buf[:n_envelope]))
        except ValueError:
            request = None
        if not _valid_envelope(request) or len(inc.fds) != 3:
            self.say("refused a request: not a task request (its envelope or descriptors)")
            self.drop(fd)
            return None
        if _load_time_env(request["env"]) != self.loaded_with:  # the host's libraries were loaded with other values
            with contextlib.suppress(OSError):
                inc.conn.send(b"R" + struct.pack(">q", 0))
            self.drop(fd)
            return None
        arguments = bytes(inc.buf[n_envelope:])
        del self.incoming[fd]
        self.poller.unregister(fd)
        pid = os.fork()
        if pid == 0:
            return self._become_child(inc, request, arguments)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpgid(pid, pid)  # also set in the child: whichever runs first
        for stdio in inc.fds:
            os.close(stdio)
        conn = inc.conn
        conn.setblocking(True)
        self.children[pid] = conn
        self.by_fd[conn.fileno()] = pid
        self.poller.register(conn, select.POLLIN | select.POLLHUP)
        with contextlib.suppress(OSError):
            conn.sendall(b"S" + struct.pack(">q", pid))
        return None

    def _become_child(self, inc: _Incoming, request: dict[str, Any], arguments: bytes) -> _Child:
        """In the forked child: mark it first (nothing of the host's clean-up may run here), die with the host,
        take the stub's stdio, and drop every descriptor of the host's."""
        global _in_child
        _in_child = True
        try:
            if self.prctl is not None:
                self.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != self.pid:  # the host died before the prctl
                os._exit(128 + signal.SIGKILL)
            os.setpgid(0, 0)
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
            for target, fd in enumerate(inc.fds):
                os.dup2(fd, target)
                os.close(fd)
            inc.fds = []
            inc.conn.close()
            for other in self.incoming.values():
                other.close()
            for c in self.children.values():
                c.close()
            self.listener.close()
            for fd in (self.alive_fd, self.wake_r, self.wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            return _Child(request, arguments)
        except BaseException:  # noqa: BLE001 - never back into the host's loop
            with contextlib.suppress(Exception):
                traceback.print_exc()
            os._exit(1)

    def stub_event(self, fd: int) -> None:
        """Something on a running child's connection: the stub closed it (nobody waits for the task any more)."""
        conn = self.children[self.by_fd[fd]]
        try:
            data = conn.recv(4096, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            return  # a stub sends nothing after its request: ignored
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.by_fd[fd], signal.SIGTERM)
        with contextlib.suppress(KeyError, ValueError):
            self.poller.unregister(fd)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            self.by_fd.pop(conn.fileno(), None)
            with contextlib.suppress(KeyError, ValueError):
                self.poller.unregister(conn)
            with contextlib.suppress(OSError):
                conn.sendall(b"E" + struct.pack(">q", os.waitstatus_to_exitcode(status)))
            conn.close()

    def stop(self) -> None:
        """The host's clean-up (never in a child): kill the children's groups, wait for them, close the rest."""
        if _in_child or os.getpid() != self.pid:
            return
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        for fd in list(self.incoming):
            self.drop(fd)


def serve(listener_fd: int, alive_fd: int, preload: Sequence[str] = PRELOAD, *, token: bytes,
          deadline_s: float = REQUEST_DEADLINE_S) -> _Child | None:
    """The host's loop: fork a child per request until the runner's pipe closes, importing `preload` meanwhile.

    The modules are imported one at a time while no request waits, so a task that arrives early is forked at
    once and imports what is not loaded yet itself, while the host goes on with the rest on another core (a task
    never waits for the whole preload). Connections are read as their bytes arrive (one thread, `poll`), each
    within `deadline_s` of its accept.

    Args:
        listener_fd, alive_fd: the listening socket and the runner's pipe end (closed: the run ended).
        preload: the modules to import, in order.
        token: the run's secret (`TOKEN_BYTES` bytes) a request must carry.
        deadline_s: seconds from a connection's accept by which its whole request must have arrived.

    Returns:
        In a forked child, the `_Child` to run (the loop's frames are left behind; the host's clean-up does not
        run there); in the host, None when it stops.
    """
    import gc

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner stops the run and its processes (_stop_children)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    host = _Host(listener_fd, alive_fd, token, deadline_s)
    signal.set_wakeup_fd(host.wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = list(preload)
    try:
        while not stopping:
            events = host.poller.poll(host.timeout_ms(bool(pending)))
            for fd, _ev in events:
                if fd == alive_fd:
                    stopping.append(1)
                elif fd == host.wake_r:
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        os.read(host.wake_r, 4096)
                elif fd == listener_fd:
                    host.accept()
                elif fd in host.incoming:
                    child = host.read(fd)
                    if child is not None:
                        return child
                elif fd in host.by_fd:
                    host.stub_event(fd)
            host.expire()
            host.reap()
            if pending and not events and not stopping:
                with contextlib.suppress(Exception):
                    importlib.import_module(pending.pop(0))
                if not pending:
                    gc.collect()
                    gc.freeze()  # the children do not copy the preloaded objects' pages when their collector runs
    finally:
        host.stop()  # returns at once in a child
    return None


def main(argv: list[str]) -> int:
    """`python -m tailguard.core.taskhost [--deadline=S] LISTENER_FD ALIVE_FD [MODULE ...]` (started by
    `task_host`, with the run's token in $TAILGUARD_TASK_HOST_TOKEN)."""
    deadline_s = REQUEST_DEADLINE_S
    while argv and argv[0].startswith("--deadline="):
        deadline_s = float(argv.pop(0).split("=", 1)[1])
    try:
        token = bytes.fromhex(os.environ.pop(ENV_TASK_HOST_TOKEN, ""))
    except ValueError:
        token = b""
    if len(token) != TOKEN_BYTES:
        print(f"tailguard task host: ${ENV_TASK_HOST_TOKEN} must hold {TOKEN_BYTES} bytes in hex (task_host sets "
              "it); not serving", file=sys.stderr, flush=True)
        return 2
    child = serve(int(argv[0]), int(argv[1]), argv[2:], token=token, deadline_s=deadline_s)
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
