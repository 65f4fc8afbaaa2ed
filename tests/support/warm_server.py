"""The suite's one warm Spark Connect server (`dcptool spark start`), in a state directory of
its own, shared by every test that replays on a warm server (tests/replay/test_spark_connect.py,
tests/hostile/test_adversary_process.py): one JVM start for them instead of one per module.

`ensure(*args)` starts it when it is not running (on a picked port, picked again when another
program took it meanwhile: the JVM's gRPC port is given on the command line, it cannot bind
port 0 and report it; docs/TESTING.md's retry-on-conflict) and otherwise runs `spark start`
on the running one, which is idempotent and says "already running". A test that stops it (the
`spark stop` and idle-timeout test) leaves it stopped: the next `ensure` starts it again, so
no test depends on the order. The session fixture `warm_server` (tests/conftest.py) stops
it at the end of the run."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.paths import ROOT
from tests.support.ports import PortTaken, pick_port, start_with_retry

STATE_ENV = "DCPTOOL_STATE_DIR"


class WarmServer:
    """The shared server's state directory and the port it runs on (None until started)."""

    def __init__(self, state_dir: str) -> None:
        self.dir = state_dir
        self.port: int | None = None

    def env(self, **extra: str) -> dict[str, str]:
        """os.environ with the server's state directory (and `extra`)."""
        return dict(os.environ, PYTHONPATH=str(ROOT), **{STATE_ENV: self.dir}, **extra)

    def dcptool(self, *args: str, env: dict[str, str] | None = None, timeout: float = 300,
                cwd: str | None = None) -> subprocess.CompletedProcess:
        """`dcptool ARGS` in a fresh process with this state directory."""
        return subprocess.run([sys.executable, "-m", "dcptool.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=self.env(**(env or {})), cwd=cwd)

    def running(self):
        """The server's record when it runs (connect_server.current() on this directory)."""
        from dcptool.replay.spark import connect_server
        with self._state():
            return connect_server.current()

    @contextmanager
    def _state(self) -> Iterator[None]:
        saved = os.environ.get(STATE_ENV)
        os.environ[STATE_ENV] = self.dir
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(STATE_ENV, None)
            else:
                os.environ[STATE_ENV] = saved

    def start(self, *args: str) -> subprocess.CompletedProcess:
        """`spark start --port P ARGS --json`: P is the running server's port, else a picked
        one, picked again when the start failed because another program took it."""
        def attempt() -> tuple[int, subprocess.CompletedProcess]:
            rec = self.running()
            port = rec.port if rec is not None else pick_port()
            r = self.dcptool("spark", "start", "--port", str(port), *args, "--json", timeout=400)
            if r.returncode != 0 and rec is None and ("is taken by another program" in r.stderr
                                                      or "in use" in r.stderr or self._bind_failed()):
                raise PortTaken(r.stderr)
            return port, r
        self.port, r = start_with_retry(attempt)
        return r

    def ensure(self) -> subprocess.CompletedProcess:
        """The server running with a 10-minute idle timeout (started if it is not)."""
        r = self.start("--idle-timeout", "10m")
        assert r.returncode == 0, r.stderr
        return r

    def _bind_failed(self) -> bool:
        """The last start in the server's log failed to bind its port."""
        log = os.path.join(self.dir, "spark-connect.log")
        if not os.path.exists(log):
            return False
        with open(log, errors="replace") as f:
            last = f.read().rsplit(" starting on ", 1)[-1]
        return "Address already in use" in last or "BindException" in last

    def stop(self) -> None:
        if self.running() is not None:
            self.dcptool("spark", "stop", timeout=120)
