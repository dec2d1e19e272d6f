"""`tailguard monitor serve` in a real process of its own, on a port the kernel chose (no port-picking race).

A port picked by binding port 0 and closing the socket (`free_port`) is free only a moment: until the server binds
it, another process or a client's outgoing connection (which takes its local port from the same ephemeral range)
can take it, and the server then exits with "address already in use". `MonitorProcess` passes `--port 0`, reads
the port the kernel gave from the service's log line `HTTP ingest on HOST:PORT`, and fails at once, with the
process's log, when it exits before listening.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

_LISTENING = re.compile(r"HTTP ingest on (\S+):(\d+)")
_GRPC = re.compile(r"OIP gRPC ingest on (\S+):(\d+)")


class MonitorProcess:
    """One `tailguard monitor serve` process (own process group) on 127.0.0.1, its port chosen by the kernel.

    Args:
        args: the serve options but --host and --port (add `--probe-port N`, default 0: off; `--grpc-port 0`
            also serves gRPC on a port the kernel chooses, `grpc_port`).
        log_path: where the process's stdout and stderr go (read for the bound port, shown on failure).
        startup_timeout_s: bound on a hung start (s); not a timing assumption.

    Raises:
        pytest.fail: the process exited before it listened, or did not listen within startup_timeout_s.
    """

    def __init__(self, args: list[str], log_path: Path, startup_timeout_s: float = 120.0) -> None:
        self.log_path = Path(log_path)
        if "--probe-port" not in args:
            args = [*args, "--probe-port", "0"]
        cmd = [sys.executable, "-c", "from tailguard.cli import main; main()", "monitor", "serve", *args,
               "--host", "127.0.0.1", "--port", "0"]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + startup_timeout_s
        while (m := _LISTENING.search(self.log_path.read_text())) is None:
            if self.proc.poll() is not None:
                pytest.fail(f"monitor serve exited ({self.proc.returncode}) before listening: {self.log()}")
            if time.monotonic() > deadline:
                self.end()
                pytest.fail(f"monitor serve did not listen in {startup_timeout_s:.0f} s: {self.log()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{m.group(2)}"
        g = _GRPC.search(self.log_path.read_text())  # logged before the HTTP port listens
        self.grpc_port = int(g.group(2)) if g else None

    def log(self) -> str:
        """The last 3,000 characters the process wrote."""
        return self.log_path.read_text()[-3000:]

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None

    def end(self) -> None:
        """SIGTERM the process group, SIGKILL it if still there after 15 s."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(15)
