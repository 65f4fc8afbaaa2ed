"""`serve synapse --redis URL` (issue 38): the built-in server publishes on a real Redis as a
Synapse process does, so `synapse+redis://` and its catch-up can be tried with only
redis-server: a capture whose subscription is killed under it (CLIENT KILL TYPE pubsub), the
gap fetched with --catch-up. (Resume and catch-up: test_synapse_catchup.py over TCP and
test_synapse_catchup_workers.py against a real Synapse.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import orjson
import pytest
from click.testing import CliRunner

from dcptool.capture import synapse_capture
from dcptool.cli import cli
from dcptool.protocol.synapse.server import generated_lines
from tests.support.paths import ROOT
from tests.support.synapse_env import redis_server  # noqa: F401

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def fast_knobs(monkeypatch):
    monkeypatch.setitem(synapse_capture.DEFAULTS, "backoff_base", 0.01)
    monkeypatch.setitem(synapse_capture.DEFAULTS, "backoff_cap", 0.05)


def run(*args):
    return CliRunner().invoke(cli, list(args), env={"DCPTOOL_PASSWORD": None})


def _events(directory) -> list[int]:
    res = run("replay", str(directory), "--table", "rows", "--format", "jsonl")
    assert res.exit_code == 0, res.stderr
    return [r["token"] for r in map(orjson.loads, res.stdout.splitlines()) if r["stream"] == "events"]


def _gaps(directory) -> list:
    res = run("replay", str(directory), "--table", "gaps", "--format", "jsonl")
    assert res.exit_code == 0, res.stderr
    return res.stdout.splitlines()


def _expected(seed: int, upto: int, lines: int = 20000) -> list[int]:
    toks = set()
    for line in generated_lines(seed, lines):
        p = line.split(" ")
        if p[1] == "events" and p[3] != "batch" and int(p[3]) <= upto:
            toks.add(int(p[3]))
    return sorted(toks)


def test_a_killed_subscription_is_caught_up(serve, redis_server, tmp_path):  # noqa: F811
    s = serve("--redis", f"redis://127.0.0.1:{redis_server.port}", "--items", "0", "--rate", "400",
              "--seed", "8", "--http-port", "0")
    env = {k: v for k, v in os.environ.items() if k != "DCPTOOL_PASSWORD"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dcptool.cli", "capture",
         f"synapse+redis://127.0.0.1:{redis_server.port}?server_name=localhost", "-o", str(tmp_path),
         "--quiet", "--json", "--max-messages", "1500", "--duration", "60s",
         "--catch-up", f"master=http://{s.http}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        rc = redis_server.client()
        end = time.monotonic() + 30
        while time.monotonic() < end and not any(c.get("name", "").startswith("dcptool")
                                                 for c in rc.client_list()):
            time.sleep(0.1)      # polls CLIENT LIST until the capture has subscribed, bounded
        time.sleep(0.3)
        assert rc.client_kill_filter(_type="pubsub") >= 1
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err.decode()
    summary = orjson.loads(out)
    assert summary["connections"] >= 2
    assert _gaps(tmp_path) == []
    events = _events(tmp_path)
    assert sorted(set(events)) == [t for t in _expected(8, max(events)) if t >= min(events)]
    # each token's rows once: a state event's two rows, every other token one
    counts = {t: events.count(t) for t in set(events)}
    assert set(counts.values()) <= {1, 2}


def test_redis_mode_refuses_tcp_scenarios(redis_server):  # noqa: F811
    res = run("serve", "synapse", "--redis", f"redis://127.0.0.1:{redis_server.port}", "--drop-after", "5")
    assert res.exit_code == 2 and "--drop-after" in res.stderr
    res = run("serve", "synapse", "--redis", "http://127.0.0.1:1")
    assert res.exit_code == 2 and "redis://" in res.stderr
