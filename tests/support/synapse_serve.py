"""`dcptool serve synapse --port 0` as a subprocess: the server binds port 0 itself and prints
{"listening": "127.0.0.1:PORT"} first, which `ServeSynapse.address` holds (no port guessed
beforehand). Usable as a context manager; `stop()` terminates it and closes its pipes."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.paths import ROOT
from tests.support.processes import stop_process


class ServeSynapse:
    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dcptool.cli", "serve", "synapse", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read().decode()
            self.stop()
            raise AssertionError(f"serve synapse did not start: {err}")
        info = json.loads(line)
        self.address = info.get("listening")   # None with --redis (it publishes instead)
        self.http = info.get("http")      # with --http-port: the catch-up endpoint's HOST:PORT

    def stop(self):
        stop_process(self.proc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def fast_capture_knobs(monkeypatch) -> None:
    """A Synapse capture's back-off and connect timeout scaled down, so that tests of
    reconnects finish quickly; the behaviour is the same."""
    from dcptool.capture import synapse_capture
    monkeypatch.setitem(synapse_capture.DEFAULTS, "backoff_base", 0.01)
    monkeypatch.setitem(synapse_capture.DEFAULTS, "backoff_cap", 0.05)
    monkeypatch.setitem(synapse_capture.DEFAULTS, "connect_timeout", 5.0)
