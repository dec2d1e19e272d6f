"""The local task host (tailguard.core.taskhost) with real processes: a host started by `task_host`, stub processes
that call a `task_entry` function the way a kfp.local task does, and the bodies forked from the host.

Nothing is mocked. Waiting for a process to show up or to end polls with a generous deadline that only bounds a
failing test; no test depends on a sleep being long enough."""

from __future__ import annotations

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
