"""Catch-up against a real Synapse deployed with workers (issue 38): a main process and one
event persister (event_persister1, the writer of the events stream) on PostgreSQL, Redis
transport, each process's HTTP listener serving the `replication` resource with a
worker_replication_secret (tests/support/synapse_workers.py). Messages are sent continuously
from three threads while the capture's Redis subscription is killed twice (`CLIENT KILL TYPE
pubsub`) and the capture itself is SIGKILLed once and resumed. With `--catch-up
master=... --catch-up event_persister1=...`, every event Synapse persisted (read from its
database) is in the capture exactly once, `gaps` is empty, `verify` exits 0, and the caught-up
rows are marked (direction `catch-up`), among them events rows fetched from event_persister1."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.paths import ROOT
from tests.support.processes import interrupt, kill_if_running
from tests.support.synapse_env import SERVER_NAME, RedisServer
from tests.support.synapse_workers import (
    PostgresCluster,
    SynapseWorkers,
    workers_available,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SECRET = "dcptool-test-replication-secret"   # a throwaway secret for a throwaway server
SENTINEL = b"DCPTOOL_TEST_SENTINEL catch-up workers end"
PER_THREAD = 20


@pytest.fixture(scope="module")
def hs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SynapseWorkers, RedisServer]]:
    reason = workers_available()
    if reason:
        pytest.skip(reason)
    redis = RedisServer(tmp_path_factory.mktemp("redis-cuw"))
    pg: PostgresCluster | None = None
    server: SynapseWorkers | None = None
    try:
        pg = PostgresCluster()
        server = SynapseWorkers(tmp_path_factory.mktemp("synapse-cuw"), redis.port, pg, SECRET)
        yield server, redis
    finally:
        if server is not None:
            server.stop()
        if pg is not None:
            pg.stop()
        redis.stop()  # type: ignore[no-untyped-call]


def _capture(out: pathlib.Path, redis: RedisServer, hs: SynapseWorkers, *extra: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "DCPTOOL_PASSWORD"}
    env["DCPTOOL_REPLICATION_SECRET"] = SECRET
    catch_up = [a for name, url in hs.replication.items() for a in ("--catch-up", f"{name}={url}")]
    return subprocess.Popen(
        [sys.executable, "-m", "dcptool.cli", "capture",
         f"synapse+redis://127.0.0.1:{redis.port}?server_name={SERVER_NAME}", "-o", str(out),
         "--quiet", "--json", "--name", "dcptool-catchup-workers-it", "--duration", "300s",
         *catch_up, *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _lines(out: pathlib.Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    files = [f for f in find_captures([str(out)]) if f.protocol == "synapse"]
    if not files:
        return []
    rows: list[dict[str, Any]] = read_capture_table(files, columns=["direction", "command", "raw"]).to_pylist()
    return rows


def _wait(pred: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.2)      # polls the capture files / counters for a condition, bounded
    raise AssertionError(f"timed out waiting for {what}")


def _events_token(out: pathlib.Path) -> int:
    toks = [int(r["raw"].split(b" ")[3]) for r in _lines(out)
            if r["command"] == "RDATA" and r["raw"].startswith(b"RDATA events ") and r["raw"].split(b" ")[3].isdigit()]
    return max(toks, default=0)


def _positions_after_replicate(out: pathlib.Path, n_replicate: int) -> bool:
    rows = _lines(out)
    outs = [i for i, r in enumerate(rows) if r["direction"] == "out" and r["command"] == "REPLICATE"]
    return len(outs) >= n_replicate and any(r["command"] == "POSITION" for r in rows[outs[n_replicate - 1]:])


def test_workers_every_persisted_event_once_across_kills_and_a_resume(
        hs: tuple[SynapseWorkers, RedisServer], tmp_path: pathlib.Path) -> None:
    server, redis = hs
    out = tmp_path / "caps"
    users = [server.register(f"u{i}") for i in range(3)]
    room = server.request("POST", "/_matrix/client/v3/createRoom", {"preset": "public_chat"},
                          token=users[0]["access_token"])["room_id"]
    rq = urllib.parse.quote(room)
    for u in users[1:]:
        server.request("POST", f"/_matrix/client/v3/join/{rq}", {}, token=u["access_token"])

    proc = _capture(out, redis, server)
    sent = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def sender(k: int, user: dict[str, Any]) -> None:
        try:
            for i in range(PER_THREAD):
                server.request("PUT", f"/_matrix/client/v3/rooms/{rq}/send/m.room.message/t{k}-{i}",
                               {"msgtype": "m.text", "body": f"message {k}.{i}"}, token=user["access_token"])
                with lock:
                    sent[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    try:
        _wait(lambda: _positions_after_replicate(out, 1), "the capture's first POSITIONs")
        threads = [threading.Thread(target=sender, args=(k, u), daemon=True) for k, u in enumerate(users)]
        for t in threads:
            t.start()
        rc = redis.client()  # type: ignore[no-untyped-call]
        for kill, at in enumerate((10, 24), start=2):
            _wait(lambda: sent[0] >= at, f"{at} messages sent")
            assert rc.client_kill_filter(_type="pubsub") >= 1
            _wait(lambda: _positions_after_replicate(out, kill), "POSITIONs after the capture re-subscribed")
        _wait(lambda: sent[0] >= 36, "36 messages sent")
        proc.kill()
        proc.communicate(timeout=30)
        _wait(lambda: sent[0] >= 44, "44 messages sent while no capture ran")
        proc = _capture(out, redis, server, "--resume")
        for t in threads:
            t.join(180)
        assert not errors, errors
        assert sent[0] == 3 * PER_THREAD
        # Synapse publishes a row after the request that made it returned: wait until the
        # capture holds the newest event (live or caught up), then a marker from another
        # client tells that everything published before it is recorded
        _wait(lambda: _positions_after_replicate(out, 4), "the resumed capture's POSITIONs")
        newest = int(server.pg.query("SELECT max(stream_ordering) FROM events")[0])
        _wait(lambda: _events_token(out) >= newest, f"events token {newest} in the capture")
        rc.publish(SERVER_NAME, SENTINEL)
        _wait(lambda: any(r["raw"] == SENTINEL for r in _lines(out)), "the sentinel in the capture")
        # and every queued fetch done: the summary of a SIGINT says what was filled
        stdout, stderr = interrupt(proc)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 130, stderr.decode()
    summary = orjson.loads(stdout)
    assert summary["catch_up_failed"] == [], summary["catch_up_failed"]

    persisted = set(server.pg.query("SELECT event_id FROM events"))
    res = subprocess.run([sys.executable, "-m", "dcptool.cli", "replay", str(out), "--table", "rows",
                          "--table", "gaps", "--format", "jsonl"], cwd=ROOT, capture_output=True, timeout=300)
    assert res.returncode == 0, res.stderr.decode()
    rows = [orjson.loads(line) for line in res.stdout.splitlines()]
    gaps = [r for r in rows if r["table"] == "gaps"]
    assert gaps == []
    evs = [json.loads(r["row"])[1][0] for r in rows
           if r["table"] == "rows" and r["stream"] == "events" and json.loads(r["row"])[0] == "ev"]
    assert len(evs) == len(set(evs)), "an event counted twice"
    # the capture began after the room was made: every event persisted since is there, once
    first = min(evs, key=evs.index)
    assert set(evs) <= persisted and len(persisted - set(evs)) < len(persisted)
    assert first.startswith("$") and "'" not in first
    since = set(server.pg.query(
        "SELECT event_id FROM events WHERE stream_ordering >= "
        f"(SELECT stream_ordering FROM events WHERE event_id = '{first}')"))
    assert set(evs) == since, (sorted(since - set(evs))[:5], sorted(set(evs) - since)[:5], len(since), len(evs))
    messages = [e for e in since if e in set(evs)]
    assert len(messages) >= 3 * PER_THREAD
    lines = _lines(out)
    caught = [r for r in lines if r["direction"] == "catch-up" and r["command"] == "RDATA"]
    assert caught, "no row was caught up: the kills made no gap to fill"
    # the messages sent while no capture ran were fetched from the events writer, not main
    assert any(r["raw"].startswith(b"RDATA events event_persister1 ") for r in caught), caught[:3]
    verify = subprocess.run([sys.executable, "-m", "dcptool.cli", "verify", str(out)], cwd=ROOT,
                            capture_output=True, timeout=300)
    assert verify.returncode == 0, verify.stdout.decode() + verify.stderr.decode()
