"""`dcptool capture synapse+redis://` against a real Synapse (SQLite, Redis enabled) and a
real Redis, both started by tests/support/synapse_env.py on loopback.

While the capture runs, the test registers users, creates a room and sends messages through
the client-server HTTP API. Then it checks that the capture holds RDATA `events` rows with
exactly the event ids the HTTP API returned, a POSITION for every stream after our
REPLICATE, the same messages a second, independent subscriber saw, and that dcptool
published nothing but REPLICATE (Redis MONITOR)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse

import orjson
import pytest

from dcptool.protocol.synapse import commands as C
from dcptool.protocol.synapse.server import ANNOUNCED_STREAMS
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.paths import ROOT
from tests.support.processes import interrupt, kill_if_running
from tests.support.synapse_env import SERVER_NAME, redis_server, synapse_server  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SENTINEL = b"DCPTOOL_TEST_SENTINEL end-of-test"
CONN_NAME = "dcptool-it-capture"


class Observer:
    """A second subscriber on the same channels, and a MONITOR of every command Redis runs."""

    def __init__(self, redis_server):
        self.messages: list[tuple[str, bytes]] = []
        self.commands: list[str] = []
        self._sub = redis_server.client().pubsub()
        self._sub.subscribe(SERVER_NAME, SERVER_NAME + "/USER_IP")
        for _ in range(2):
            assert self._sub.get_message(timeout=10)["type"] == "subscribe"
        self._mon_client = redis_server.client()
        self._monitor = self._mon_client.monitor()
        self._monitor.__enter__()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._listen, daemon=True),
                         threading.Thread(target=self._watch, daemon=True)]
        for t in self._threads:
            t.start()

    def _listen(self):
        while not self._stop.is_set():
            msg = self._sub.get_message(timeout=0.2)
            if msg and msg["type"] == "message":
                self.messages.append((msg["channel"].decode(), msg["data"]))

    def _watch(self):
        try:
            for cmd in self._monitor.listen():
                self.commands.append(cmd)
                if self._stop.is_set():
                    return
        except Exception:  # noqa: BLE001 - the monitor connection closes at the end
            return

    def wait_for(self, pred, what: str, timeout: float = 60.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(pred(ch, data) for ch, data in list(self.messages)):
                return
            time.sleep(0.05)
        raise AssertionError(f"the observer never saw {what}")

    def close(self, redis_server):
        self._stop.set()
        redis_server.client().ping()  # wakes the monitor so its thread ends
        for t in self._threads:
            t.join(5)
        self._sub.close()
        try:
            self._monitor.__exit__(None, None, None)
        except Exception:  # noqa: BLE001
            pass


def _wait_capture_has(directory, raw: bytes, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        files = [f for f in find_captures([str(directory)]) if f.protocol == "synapse"]
        if files and raw in read_capture_table(files, columns=["raw"]).column("raw").to_pylist():
            return
        time.sleep(0.2)
    raise AssertionError(f"the capture never recorded {raw!r}")


def test_capture_from_real_synapse_over_redis(synapse_server, redis_server, tmp_path):  # noqa: F811
    obs = Observer(redis_server)
    out = tmp_path / "caps"
    env = {k: v for k, v in os.environ.items() if k != "DCPTOOL_PASSWORD"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dcptool.cli", "capture",
         f"synapse+redis://127.0.0.1:{redis_server.port}?server_name={SERVER_NAME}",
         "-o", str(out), "--quiet", "--json", "--name", CONN_NAME, "--duration", "240s"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # dcptool publishes REPLICATE once both subscriptions are confirmed: from then on
        # it sees everything Synapse publishes
        obs.wait_for(lambda ch, d: d == b"REPLICATE ", "dcptool's REPLICATE")
        our_ports = {c["addr"].rsplit(":", 1)[1] for c in redis_server.client().client_list()
                     if c.get("name") == CONN_NAME}
        hs = synapse_server
        alice = hs.register("alice")
        bob = hs.register("bob")
        room = hs.request("POST", "/_matrix/client/v3/createRoom",
                          {"preset": "public_chat", "name": "dcptool test"},
                          token=alice["access_token"])["room_id"]
        rq = urllib.parse.quote(room)
        hs.request("POST", f"/_matrix/client/v3/join/{rq}", {}, token=bob["access_token"])
        sent = []
        for i, who in enumerate([alice, alice, bob, alice]):
            resp = hs.request("PUT", f"/_matrix/client/v3/rooms/{rq}/send/m.room.message/t{i}",
                              {"msgtype": "m.text", "body": f"hello {i}"}, token=who["access_token"])
            sent.append(resp["event_id"])
        hs.request("PUT", f"/_matrix/client/v3/rooms/{rq}/typing/{urllib.parse.quote(alice['user_id'])}",
                   {"typing": True, "timeout": 10000}, token=alice["access_token"])
        last = sent[-1].encode()
        obs.wait_for(lambda ch, d: d.startswith(b"RDATA events ") and last in d, "the last event")
        # a marker from a third client tells us when dcptool has recorded everything before it
        redis_server.client().publish(SERVER_NAME, SENTINEL)
        _wait_capture_has(out, SENTINEL)
        stdout, stderr = interrupt(proc)
    finally:
        kill_if_running(proc)
        obs.close(redis_server)
    assert proc.returncode == 130, stderr.decode()
    summary = orjson.loads(stdout)
    assert summary["files"] and summary["gaps"] == []

    files = [f for f in find_captures([str(out)]) if f.protocol == "synapse"]
    rows = read_capture_table(files).to_pylist()
    assert [r["frame_no"] for r in rows] == list(range(len(rows)))

    # 1. events rows carry exactly the event ids the HTTP API returned for the messages
    ev_rows = [json.loads(r["row"]) for r in rows
               if r["command"] == "RDATA" and r["stream"] == "events"]
    messages = [d for kind, d in ev_rows if kind == "ev" and d[2] == "m.room.message"]
    assert [d[0] for d in messages] == sent
    assert all(d[1] == room for d in messages)
    created = [d for kind, d in ev_rows if kind == "ev" and d[2] == "m.room.create"]
    assert [d[1] for d in created] == [room]
    joins = {d[3] for kind, d in ev_rows if kind == "ev" and d[2] == "m.room.member" and d[6] == "join"}
    assert joins == {alice["user_id"], bob["user_id"]}
    # batch rows close with the token of the next numeric RDATA of the stream
    rdata = [C.Rdata(r["stream"], r["instance"], r["token"], r["row"]) for r in rows
             if r["command"] == "RDATA"]
    from dcptool.protocol.synapse.client import effective_tokens
    assert None not in effective_tokens(rdata)

    # 2. a POSITION for every stream after our REPLICATE
    i_out = next(i for i, r in enumerate(rows) if r["direction"] == "out")
    assert rows[i_out]["command"] == "REPLICATE" and rows[i_out]["raw"] == b"REPLICATE "
    assert rows[i_out]["channel"] == SERVER_NAME
    positions = {r["stream"] for r in rows[i_out:] if r["command"] == "POSITION"}
    assert positions == set(ANNOUNCED_STREAMS)
    assert summary["committed"]["events/master"] >= max(r["token"] or 0 for r in rows
                                                       if r["stream"] == "events")

    # 3. dcptool saw what an independent subscriber saw, in the same order (from our REPLICATE)
    inn = [(r["channel"], r["raw"]) for r in rows if r["direction"] == "in"]
    seen = obs.messages
    start = seen.index((SERVER_NAME, b"REPLICATE "))
    expected = [(ch, C.redact_user_ip(d)) for ch, d in seen[start:]]
    assert inn == expected[:len(inn)]
    assert inn[-1] == (SERVER_NAME, SENTINEL)
    assert any(r["command"] == "RDATA" and r["stream"] == "typing" for r in rows)

    # 4. the only thing dcptool published is REPLICATE (MONITOR sees every command; CLIENT
    #    LIST told us which connections were dcptool's)
    assert our_ports, "CLIENT LIST showed no connection named " + CONN_NAME
    ours = [c["command"] for c in obs.commands
            if str(c.get("client_port")) in our_ports and c.get("client_address") == "127.0.0.1"]
    assert any(c.upper().startswith("SUBSCRIBE") for c in ours), ours
    published = [c for c in ours if c.upper().startswith("PUBLISH")]
    assert len(published) == 1 and published[0].startswith(f"PUBLISH {SERVER_NAME} REPLICATE"), ours
    writes = {"SET", "DEL", "HSET", "LPUSH", "RPUSH", "XADD", "FLUSHALL", "FLUSHDB", "EXPIRE"}
    assert not [c for c in ours if c.split(" ")[0].upper() in writes]
