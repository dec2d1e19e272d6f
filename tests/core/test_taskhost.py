"""The local task host (tailguard.core.taskhost) with real processes: a host started by `task_host`, stub processes
that call a `task_entry` function the way a kfp.local task does, and the bodies forked from the host.

Nothing is mocked. Waiting for a process to show up or to end polls with a generous deadline that only bounds a
failing test; no test depends on a sleep being long enough."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tailguard.core.taskhost import ENV_TASK_HOST, task_host

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the task host forks (Linux only)")

PROBE = textwrap.dedent('''
    """A task module for the host tests: one task_entry function whose behaviour the test picks."""
    import json
    import os
    import signal
    import sys

    from tailguard.core.taskio import task_entry


    @task_entry("probe")
    def probe(mode, out, artifact=None):
        info = {"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
                "argv": sys.argv[1:]}
        with open(out + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(out + ".tmp", out)
        print("printed by the body", flush=True)
        if artifact is not None:
            artifact.log_metric("rows", 7.0)
        if mode == "sibling":  # onnxruntime.transformers appends its folder to sys.path at import, then imports
            import onnxruntime.transformers  # noqa: F401  (its siblings by top-level names)
            import fusion_options  # noqa: F401
        if mode == "raise":
            raise ValueError("the body failed")
        if mode == "exit3":
            raise SystemExit(3)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "block":
            sys.stdin.read()  # until the test closes the stub's stdin (it never does): the stub is killed instead
        return json.dumps({"answer": 42, "mode": mode})
''')

STUB = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from kfp import dsl
    import probe_tasks
    artifact = dsl.Metrics(name="metrics", uri="/nonexistent/metrics")
    value = probe_tasks.probe(sys.argv[2], sys.argv[3], artifact=artifact)
    print("STUB " + json.dumps({"value": value, "metadata": artifact.metadata}), flush=True)
''')


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """One task host for the module (its preload takes seconds), with $TAILGUARD_TASK_HOST set while it lives."""
    folder = tmp_path_factory.mktemp("host")
    (folder / "probe_tasks.py").write_text(PROBE)
    (folder / "stub.py").write_text(STUB)
    saved = os.environ.pop(ENV_TASK_HOST, None)
    with task_host(folder) as path:
        assert path is not None and Path(path).exists()
        yield folder
    if saved is not None:
        os.environ[ENV_TASK_HOST] = saved


def _stub(folder: Path, mode: str, out: Path, *, env: dict[str, str] | None = None,
          stdin: int | None = subprocess.DEVNULL, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(folder / "stub.py"), str(folder), mode, str(out)],
                            cwd=str(out.parent), env={**os.environ, "PROBE_VALUE": "from-the-stub", **(env or {})},
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for(check, what: str, deadline_s: float = 120.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _stub_result(stdout: str) -> dict:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("STUB "))
    return json.loads(line[len("STUB "):])


def test_task_host_runs_the_body_in_a_child_of_the_host_and_returns_its_value_and_metadata_when_hosted(host, tmp_path):
    out = tmp_path / "info.json"
    proc = _stub(host, "ok", out)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    info = json.loads(out.read_text())
    assert info["pid"] != proc.pid  # the body ran in another process ...
    assert psutil.Process(info["ppid"]).cmdline()[1:3] == ["-m", "tailguard.core.taskhost"]  # ... forked by the host
    assert info["cwd"] == str(tmp_path) and info["env"] == "from-the-stub"  # with the stub's folder and environment
    assert info["argv"] == [str(host), "ok", str(out)]
    result = _stub_result(stdout)
    assert json.loads(result["value"]) == {"answer": 42, "mode": "ok"}
    assert result["metadata"] == {"rows": 7.0}  # Output[Metrics] written in the child reaches the KFP executor
    assert "printed by the body" in stdout  # the body's stdout is the stub's (the task's log)
    timing = next(json.loads(ln.split("TAILGUARD_TASK_TIMING ", 1)[1]) for ln in stdout.splitlines()
                  if "TAILGUARD_TASK_TIMING " in ln)
    assert timing["hosted"] is True and timing["ok"] is True


def test_task_host_child_keeps_the_import_path_entries_the_host_imports_added_when_a_body_needs_them(host, tmp_path):
    import tailguard.core.taskhost as th

    assert "onnxruntime.quantization" in th.PRELOAD  # which imports onnxruntime.transformers in the host
    proc = _stub(host, "sibling", tmp_path / "info.json")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert json.loads(_stub_result(stdout)["value"])["mode"] == "sibling"


def test_task_host_stub_exits_1_with_the_traceback_in_its_log_when_the_body_raises(host, tmp_path):
    proc = _stub(host, "raise", tmp_path / "info.json")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "ValueError: the body failed" in stderr and "TAILGUARD_ERROR " in stderr
    assert "STUB " not in stdout


def test_task_host_stub_exits_with_the_body_exit_code_when_the_body_raises_systemexit(host, tmp_path):
    proc = _stub(host, "exit3", tmp_path / "info.json")
    proc.communicate(timeout=300)
    assert proc.returncode == 3


def test_task_host_stub_fails_naming_the_signal_when_the_body_process_is_killed(host, tmp_path):
    proc = _stub(host, "kill", tmp_path / "info.json")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGKILL
    assert "killed by signal 9" in stderr


def test_task_host_terminates_the_body_when_its_stub_is_killed(host, tmp_path):
    out = tmp_path / "info.json"
    proc = _stub(host, "block", out, stdin=subprocess.PIPE)
    info = _wait_for(lambda: out.exists() and json.loads(out.read_text()), "the body to start")
    body = psutil.Process(info["pid"])
    assert body.is_running()
    proc.kill()
    proc.communicate(timeout=60)
    _wait_for(lambda: not body.is_running() or body.status() == psutil.STATUS_ZOMBIE, "the body to be stopped")


def test_task_host_runs_the_body_in_the_stub_when_hosting_is_off_or_a_load_time_variable_differs(host, tmp_path):
    for env in ({ENV_TASK_HOST: "0"}, {"OMP_NUM_THREADS": "7"}):
        out = tmp_path / "info.json"
        proc = _stub(host, "ok", out, env=env)
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        assert json.loads(out.read_text())["pid"] == proc.pid, env  # no host child: the stub's own process
        timing = next(json.loads(ln.split("TAILGUARD_TASK_TIMING ", 1)[1]) for ln in stdout.splitlines()
                      if "TAILGUARD_TASK_TIMING " in ln)
        assert timing["hosted"] is False
        assert _stub_result(stdout)["metadata"] == {"rows": 7.0}


def test_task_host_stops_its_bodies_and_exits_when_the_run_ends(tmp_path):
    (tmp_path / "probe_tasks.py").write_text(PROBE)
    (tmp_path / "stub.py").write_text(STUB)
    out = tmp_path / "info.json"
    saved = os.environ.pop(ENV_TASK_HOST, None)
    try:
        with task_host(tmp_path) as path:
            proc = _stub(tmp_path, "block", out, stdin=subprocess.PIPE)
            info = _wait_for(lambda: out.exists() and json.loads(out.read_text()), "the body to start")
            host_pid = info["ppid"]
        assert os.environ.get(ENV_TASK_HOST) is None and not Path(path).exists()
        _, stderr = proc.communicate(timeout=60)  # its body was killed with the host: the stub does not hang
        assert proc.returncode != 0
        assert not psutil.pid_exists(info["pid"]) or psutil.Process(info["pid"]).status() == psutil.STATUS_ZOMBIE
        assert not psutil.pid_exists(host_pid) or psutil.Process(host_pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if saved is not None:
            os.environ[ENV_TASK_HOST] = saved


def test_task_host_starts_no_host_when_one_is_already_set(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_TASK_HOST, "0")
    with task_host(tmp_path) as path:
        assert path is None and os.environ[ENV_TASK_HOST] == "0"
    assert not (tmp_path / "task-host.sock").exists()


# ------------------------------------------------------------------ issue 36 items 3 and 4: light hosts and stubs
# A host with a trivial preload starts in well under a second; these stubs import only the task host's module (no
# kfp) and call `call_in_host` the way `task_entry` does, so a hundred of them fit on a small machine.
LIGHT = textwrap.dedent('''
    """Bodies for the light host tests."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time


    def barrier(folder, n):
        """Mark this body started, then wait until `n` bodies have: all of them run at the same time."""
        open(os.path.join(folder, str(os.getpid())), "w").close()
        end = time.monotonic() + 500  # bounds a failing test only
        while len(os.listdir(folder)) < n:
            if time.monotonic() > end:
                raise SystemExit(5)
            time.sleep(0.2)
        return os.getpid()


    def info(out, mode):
        data = {"pid": os.getpid(), "ppid": os.getppid(), "uid": os.getuid()}
        if mode == "grandchild":  # a process the body starts (in the body's process group), that never ends itself
            data["grandchild"] = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"]).pid
        with open(out + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(out + ".tmp", out)
        if mode in ("block", "grandchild"):
            sys.stdin.read()  # until the test closes the stub's stdin or the process is killed
        return data
''')

LIGHT_STUB = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from tailguard.core.taskhost import NOT_HOSTED, call_in_host
    import light_tasks
    fn, args = getattr(light_tasks, sys.argv[2]), tuple(json.loads(sys.argv[3]))
    value = call_in_host(fn, args, {})
    hosted = value is not NOT_HOSTED
    if not hosted:
        value = fn(*args)
    print("STUB " + json.dumps({"value": value, "hosted": hosted}), flush=True)
''')


@pytest.fixture()
def light(tmp_path):
    """A folder with the light task module and stub, $TAILGUARD_TASK_HOST unset while the test runs."""
    (tmp_path / "light_tasks.py").write_text(LIGHT)
    (tmp_path / "light_stub.py").write_text(LIGHT_STUB)
    saved = os.environ.pop(ENV_TASK_HOST, None)
    yield tmp_path
    if saved is not None:
        os.environ[ENV_TASK_HOST] = saved


def _light_stub(folder: Path, fn: str, *args, stdin: int | None = subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(folder / "light_stub.py"), str(folder), fn, json.dumps(args)],
                            cwd=str(folder), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _still_open(conn) -> bool:
    import socket

    try:
        return conn.recv(1, socket.MSG_DONTWAIT) != b""  # data: open (the host never sends to a request first)
    except BlockingIOError:
        return True  # nothing to read and not closed
    except OSError:
        return False


def test_task_host_completes_every_task_when_100_run_at_once(light):
    """Issue 36 item 3: a forked child ran the host's clean-up and SIGKILLed its siblings (99 of 100 exit 137)."""
    started = light / "started"
    started.mkdir()
    with task_host(light, preload=("json",)):
        procs = [_light_stub(light, "barrier", str(started), 100) for _ in range(100)]
        try:  # the bodies wait for each other, so one failed stub is failure: do not wait for the barrier then
            _wait_for(lambda: all(p.poll() is not None for p in procs) or any(p.poll() for p in procs),
                      "the 100 tasks", deadline_s=500)
        finally:
            codes = [p.poll() for p in procs]
            for p in procs:
                if p.poll() is None:
                    p.kill()  # its body still holds the stub's stdout: the host's exit below ends it
        if codes != [0] * 100:
            pytest.fail(f"{sum(1 for c in codes if c)} of 100 tasks failed (exit codes {sorted(set(codes), key=str)}), "
                        f"{codes.count(None)} still running")
        results = [(p, *p.communicate(timeout=300)) for p in procs]
    values = [_stub_result(out) for _, out, _ in results]
    assert all(v["hosted"] for v in values)  # every body ran in a child of the host ...
    assert len({v["value"] for v in values}) == 100  # ... each its own process, all of them at once (the barrier)


def test_task_host_runs_a_task_while_an_idle_and_a_trickling_connection_stay_open(light):
    """Issue 36 item 4: one idle connection delayed a real task by the host's 60 s read timeout."""
    import socket

    out = light / "info.json"
    with task_host(light, preload=("json",), request_deadline_s=3600) as path:
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.connect(path)
        trickling = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        trickling.connect(path)
        socket.send_fds(trickling, [b"TGH2"], [0, 1, 2])  # the start of a header, the rest never comes
        proc = _light_stub(light, "info", str(out), "ok")
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        assert _stub_result(stdout)["hosted"] is True
        assert _still_open(idle) and _still_open(trickling)  # the task did not wait for either of them
        idle.close()
        trickling.close()


def test_task_host_closes_a_connection_when_its_request_is_not_whole_by_the_deadline(light, capfd):
    """A client that sends a byte at a time is closed at the deadline (a total from the accept, not per read)."""
    import socket

    with task_host(light, preload=("json",), request_deadline_s=0.5) as path:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        sent = [0]

        def closed_after_a_byte():
            try:
                if sent[0] < 47:  # never a whole 48-byte header: only the deadline can close it
                    sent[0] += conn.send(b"T")
            except OSError:
                return True  # the host closed it (EPIPE / ECONNRESET)
            return not _still_open(conn)

        _wait_for(closed_after_a_byte, "the host to close the trickling connection")
        conn.close()
    assert "closed a connection whose request did not arrive within 0.5 s" in capfd.readouterr().err


def test_task_host_decodes_and_runs_nothing_when_a_request_lacks_the_run_token(light):
    """Issue 36 item 4: a pickle in the request ran in the host before the fork. The host now reads a token first,
    decodes only JSON, and leaves the arguments' pickle to the task's own process."""
    import pickle
    import socket
    import struct

    marker = light / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    bomb = pickle.dumps({"target": "os:getpid", "args": (Payload(),), "kwargs": {}})
    envelope = json.dumps({"target": "light_tasks:info", "env": dict(os.environ), "cwd": str(light), "argv": [],
                           "path": [str(light)], "result": str(light / "result")}).encode()
    with task_host(light, preload=("json",)) as path:
        proc = _light_stub(light, "info", str(light / "info.json"), "ok")
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        host_fds = len(os.listdir(f"/proc/{_stub_result(stdout)['value']['ppid']}/fd"))
        for request, body in ((b"TGH1" + struct.pack(">Q", len(bomb)), bomb),  # the old protocol's pickle
                              (struct.pack(">4s32sIQ", b"TGH2", bytes(32), len(envelope), len(bomb)),
                               envelope + bomb)):  # the new one with a wrong token
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            socket.send_fds(conn, [request], [0, 1, 2])
            with contextlib.suppress(OSError):  # the host may close it before all of it is sent
                conn.sendall(body)
            try:
                answer = conn.recv(9)
            except ConnectionResetError:  # closed with the request unread
                answer = b""
            assert answer == b""  # closed without an answer: nothing forked
            conn.close()
        # a real task still runs (the host lives), and only then is the marker checked
        proc = _light_stub(light, "info", str(light / "info.json"), "ok")
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0 and _stub_result(stdout)["hosted"] is True, stderr
        host = _stub_result(stdout)["value"]["ppid"]
        # the refused requests' descriptors (three each, and the connection) were closed; `<=`: the first count may
        # still have held its task's connection, which the host closes right after sending the status
        _wait_for(lambda: len(os.listdir(f"/proc/{host}/fd")) <= host_fds, "the host's descriptors to be closed")
    assert not marker.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root; test_peer_refusal_* covers the "
                    "check function")
def test_task_host_refuses_a_request_when_it_comes_from_another_uid(light, capfd, monkeypatch):
    """Issue 36 item 4: no SO_PEERCRED check. The socket is opened to everyone here (mode 0666 in a world-readable
    folder) to reach the check behind the file mode; a process that switched to uid 65534 asks through the real
    stub path (`call_in_host`), and the host must neither fork for it nor run its target."""
    import tempfile

    from tailguard.core.taskhost import NOT_HOSTED, call_in_host

    folder = Path(tempfile.mkdtemp(prefix="tailguard-peer-"))
    try:
        os.chmod(folder, 0o777)
        (folder / "light_tasks.py").write_text(LIGHT)
        monkeypatch.syspath_prepend(str(folder))
        import light_tasks

        out = folder / "info.json"
        with task_host(folder, preload=("json",)) as path:
            os.chmod(path, 0o666)
            pid = os.fork()
            if pid == 0:  # another user's process: the real stub path
                code = 4
                try:
                    os.setgroups([])
                    os.setgid(65534)
                    os.setuid(65534)
                    value = call_in_host(light_tasks.info, (str(out), "ok"), {})
                    code = 0 if value is NOT_HOSTED else 3
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # refused: the stub would run its body itself
        assert not out.exists()  # and the host ran nothing for it
        assert "refused a connection from pid" in capfd.readouterr().err
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        sys.modules.pop("light_tasks", None)


def test_peer_refusal_names_the_uid_when_the_peer_is_another_user():
    """The check behind SO_PEERCRED, at its seam: another uid is refused with a reason naming it; the same passes
    (its request must still carry the run's token)."""
    from tailguard.core.taskhost import peer_refusal

    assert "uid 1234" in peer_refusal(42, 1234, 1234, host_uid=1000)
    assert peer_refusal(42, 1000, 1000, host_uid=1000) is None


def test_task_host_children_die_when_the_host_is_sigkilled(light):
    """Issue 36 item 4: a SIGKILLed host left its task children running under pid 1. The stub is stopped first,
    so only the child's PR_SET_PDEATHSIG can end it."""
    out = light / "info.json"
    with task_host(light, preload=("json",)):
        proc = _light_stub(light, "info", str(out), "block", stdin=subprocess.PIPE)
        info = _wait_for(lambda: out.exists() and json.loads(out.read_text()), "the body to start")
        assert info["pid"] != proc.pid
        proc.send_signal(signal.SIGSTOP)
        try:
            os.kill(info["ppid"], signal.SIGKILL)
            _wait_for(lambda: _gone(info["pid"]), "the body to end with its host")
        finally:
            proc.send_signal(signal.SIGCONT)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "ended without a status" in stderr


def test_task_host_stub_kills_the_body_process_group_when_the_host_is_sigkilled(light):
    """What the body started is not the host's child: its stub, seeing the host gone, kills the body's group."""
    out = light / "info.json"
    with task_host(light, preload=("json",)):
        proc = _light_stub(light, "info", str(out), "grandchild", stdin=subprocess.PIPE)
        info = _wait_for(lambda: out.exists() and json.loads(out.read_text()), "the body to start")
        os.kill(info["ppid"], signal.SIGKILL)
        _wait_for(lambda: _gone(info["pid"]) and _gone(info["grandchild"]), "the body and its process to end")
        proc.communicate(timeout=300)
    assert proc.returncode == 1
