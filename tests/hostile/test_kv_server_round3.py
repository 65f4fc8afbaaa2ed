"""Issue 36, the KV side of `serve dcp` (findings 5, 6, 7, 9 and 11): what one connection may
have queued is bounded, durability is honoured by every write command that takes it, a
legal 20 MiB value is stored and a larger one is E2BIG on an open connection, a schedule
is checked before listening, and running out of file descriptors is one warning line."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import subprocess
import time

import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.bucket import vbucket_of
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import Feature, Opcode, Status
from dcptool.protocol.dcp.wire.frames import split
from tests.support.kv_model import JSON_FLAGS, VBS, Kv, frames, history, single
from tests.support.paths import DCPTOOL
from tests.support.processes import stop_process

MIB = 1024 * 1024


@contextlib.contextmanager
def serving(*args: str, **popen):
    """`dcptool serve dcp --port 0 --items 0 --vbuckets 8 ARGS`: yields (process, port)."""
    proc = subprocess.Popen([DCPTOOL, "serve", "dcp", "--port", "0", "--items", "0", "--vbuckets", "8", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        yield proc, int(json.loads(line)["listening"].rsplit(":", 1)[1])
    finally:
        stop_process(proc)


class Raw:
    """A KV client on a plain socket: HELLO (JSON, mutation seqnos), SELECT_BUCKET, then
    whatever the test sends; answers read whole, in order."""

    def __init__(self, port: int, timeout: float = 60.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = bytearray()
        self.opaque = 0
        self.send(m.Hello(opaque=1, features=(Feature.JSON, Feature.MUTATION_SEQNO)),
                  m.SelectBucket(opaque=2, bucket=b"default"))
        assert [r.status for r in self.answers(2)] == [0, 0]

    def req(self, opcode: int, key: bytes = b"", **kw) -> m.Request:
        self.opaque += 1
        return m.Request(opcode=opcode, opaque=self.opaque, key=key, vbucket=vbucket_of(key, VBS), **kw)

    def send(self, *msgs) -> None:
        self.sock.sendall(b"".join(m.encode(x) for x in msgs))

    def answers(self, n: int) -> list:
        """The next n frames from the server (ConnectionError when it closes first)."""
        while True:
            bounds, _ = split(self.buf, max_body=64 * MIB)
            if len(bounds) >= n:
                o, ln = bounds[n - 1]
                out = [m.decode_bytes(bytes(self.buf[a:a + b])) for a, b in bounds[:n]]
                del self.buf[:o + ln]
                return out
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("closed by the server")
            self.buf += chunk

    def set(self, key: bytes, value: bytes) -> m.Response:
        self.send(self.req(Opcode.SET, key, extras=struct.pack(">II", 0, 0), value=value))
        return self.answers(1)[0]

    def close(self) -> None:
        self.sock.close()

# --------------------------------------------------------------------------- 6: durability

COUNTER = struct.pack(">QQI", 1, 10, 0)                 # delta 1, initial 10, no expiry
DURABLE_WRITES = [                                     # (name, opcode, extras, value, needs the document)
    ("increment", Opcode.INCREMENT, COUNTER, b"", True),
    ("decrement", Opcode.DECREMENT, COUNTER, b"", True),
    ("new-counter", Opcode.INCREMENT, COUNTER, b"", False),
    ("append", Opcode.APPEND, b"", b"-tail", True),
    ("prepend", Opcode.PREPEND, b"", b"head-", True),
    ("touch", Opcode.TOUCH, struct.pack(">I", 60), b"", True),
    ("get-and-touch", Opcode.GAT, struct.pack(">I", 60), b"", True),
]


@pytest.mark.parametrize("name,opcode,extras,value,existing", DURABLE_WRITES, ids=[w[0] for w in DURABLE_WRITES])
def test_durable_write_commands_are_impossible_without_replicas(name, opcode, extras, value, existing):
    """`--replicas 0`: as a durable set or delete, DURABILITY_IMPOSSIBLE and nothing written."""
    kv = Kv(single())
    key = b"k-" + name.encode()
    if existing:
        assert kv.upsert(key, value=b"7", flags=0).status == 0
    before = history(kv.model, key)
    rsp = kv.call(opcode, key, extras=extras, value=value, durability=1)
    assert rsp.status == Status.DURABILITY_IMPOSSIBLE, name
    assert history(kv.model, key) == before
    assert kv.upsert(key, value=b"8", flags=0, durability=1).status == Status.DURABILITY_IMPOSSIBLE   # as set


@pytest.mark.parametrize("name,opcode,extras,value,existing", DURABLE_WRITES, ids=[w[0] for w in DURABLE_WRITES])
def test_durable_write_commands_prepare_then_answer_with_the_commit(name, opcode, extras, value, existing):
    """With a replica: a DCP prepare, no answer until the commit, the key blocked meanwhile;
    then the answer as the plain command gives it, with the commit's CAS and seqno."""
    model = P.server_from_options(vbuckets=VBS, items=0, seed=1, nodes=3, replicas=1)
    key = b"k-" + name.encode()
    kv = Kv(model, node=model.cluster.vbmap[vbucket_of(key, VBS)][0])
    if existing:
        assert kv.upsert(key, value=b"7", flags=0).status == 0
    kv.send(kv.req(opcode, key, extras=extras, value=value, durability=1),
            kv.req(Opcode.SET, key, extras=struct.pack(">II", JSON_FLAGS, 0), value=b"9"))
    out = [f for f in frames(kv.conn) if f.IS_RESPONSE]
    assert [f.status for f in out] == [Status.SYNC_WRITE_IN_PROGRESS]      # the durable one waits
    assert history(model, key)[-1][1] == "p"
    kv.conn.tick(0.0)
    out = [f for f in frames(kv.conn) if f.IS_RESPONSE]
    assert len(out) == 1 and out[0].status == 0
    hist = history(model, key)
    assert [h[1] for h in hist[-2:]] == ["p", "c"] and out[0].cas == hist[-1][3]
    got = kv.call(Opcode.GET, key)
    expected = {"increment": b"8", "decrement": b"6", "new-counter": b"10", "append": b"7-tail", "prepend": b"head-7"}.get(name, b"7")
    assert got.value == expected and got.cas == out[0].cas
    if opcode in (Opcode.INCREMENT, Opcode.DECREMENT):
        assert out[0].value == struct.pack(">Q", int(expected))
    if opcode == Opcode.GAT:
        assert out[0].value == b"7"
    if opcode in (Opcode.INCREMENT, Opcode.DECREMENT, Opcode.APPEND, Opcode.PREPEND):
        assert struct.unpack(">QQ", out[0].extras)[1] == hist[-1][0]     # the mutation token: the commit


def test_durability_on_a_command_that_takes_none_is_einval():
    """kv_engine refuses a durability frame info on a read (EINVAL), it does not ignore it."""
    model = P.server_from_options(vbuckets=VBS, items=0, seed=1, nodes=3, replicas=1)
    key = b"read"
    kv = Kv(model, node=model.cluster.vbmap[vbucket_of(key, VBS)][0])
    assert kv.upsert(key).status == 0
    for opcode, extras in ((Opcode.GET, b""), (Opcode.GET_LOCKED, b""), (Opcode.GET_META, b"")):
        assert kv.call(opcode, key, extras=extras, durability=1).status == Status.EINVAL
    assert [h[1] for h in history(model, key)] == ["m"]
    assert isinstance(kv.call(Opcode.GET, key), m.Response)


# --------------------------------------------------------------------------- 5: queued answers

def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def peak_rss_mib(pid: int, quiet: float = 2.0, bound: float = 20.0) -> float:
    """The server's highest RSS until it has not grown for `quiet` seconds (at most `bound`)."""
    peak = rss_mib(pid)
    still = time.monotonic()
    end = still + bound
    while time.monotonic() < end and time.monotonic() - still < quiet:
        time.sleep(0.1)
        now = rss_mib(pid)
        if now > peak + 1:
            peak, still = now, time.monotonic()
    return peak


GETS = 300                          # pipelined GETs of a 1 MiB document: 300 MiB of answers


def _pipeline_gets(c: Raw, key: bytes) -> list[int]:
    reqs = [c.req(Opcode.GET, key) for _ in range(GETS)]
    c.send(*reqs)                   # ~9 KB of requests, and nothing read
    return [r.opaque for r in reqs]


def _read_all(c: Raw, opaques: list[int], value: bytes) -> None:
    """Every answer, in order, whole."""
    got = []
    for _ in range(len(opaques)):
        r = c.answers(1)[0]
        assert r.status == 0 and r.value == value
        got.append(r.opaque)
    assert got == opaques


@pytest.mark.integration
def test_a_client_that_pipelines_and_never_reads_does_not_grow_the_server():
    """Issue 36 #5 as found: a KV client pipelines GETs of a 1 MiB document and reads
    nothing. The server stops reading it once 4 MiB are queued (it used to answer all of them
    into memory: 1.7 GiB for 32 KB of requests); then the client reads every answer, in order."""
    doc = bytes(range(256)) * 4096
    with serving() as (proc, port):
        c = Raw(port, timeout=120)
        assert c.set(b"big", doc).status == 0
        before = peak_rss_mib(proc.pid, quiet=0.5)
        opaques = _pipeline_gets(c, b"big")
        grown = peak_rss_mib(proc.pid) - before
        assert grown < 64, f"the server grew by {grown:.0f} MiB for a client that reads nothing"
        _read_all(c, opaques, doc)
        c.send(c.req(Opcode.NOOP_CLIENT))
        assert c.answers(1)[0].status == 0
        c.close()


def test_what_one_connection_queues_is_bounded_and_it_is_read_again_once_drained():
    """The same in-process, on the server's own counters: the most one connection had queued
    is the write bound plus one answer; reading stopped, and resumed when the peer drained."""
    from dcptool.protocol.transport.dcp_server import WRITE_HIGH
    from tests.support.threaded_server import ThreadedServer
    doc = b"d" * MIB
    with ThreadedServer(P.server_from_options(vbuckets=VBS, items=0, seed=1)) as srv:
        c = Raw(srv.port, timeout=120)
        assert c.set(b"big", doc).status == 0
        opaques = _pipeline_gets(c, b"big")
        deadline = time.monotonic() + 30
        while srv.server.read_pauses == 0:
            assert time.monotonic() < deadline, "the connection was never paused"
            time.sleep(0.01)
        _read_all(c, opaques, doc)
        assert srv.server.peak_queued <= WRITE_HIGH + len(doc) + 64
        c.close()


# --------------------------------------------------------------------------- 7: value sizes

@pytest.mark.integration
def test_a_20_mib_value_is_stored_a_larger_one_is_e2big_and_only_a_huge_frame_drops(tmp_path):
    """kv_engine's two limits: a value of exactly 20 MiB is stored and read back; 20 MiB + 1
    is E2BIG (0x03) on a connection that stays open; only a frame above the 30 MiB packet
    limit drops the connection (its header is enough)."""
    with serving() as (_, port):
        c = Raw(port)
        legal = b"v" * (20 * MIB)
        assert c.set(b"big", legal).status == 0
        c.send(c.req(Opcode.GET, b"big"))
        got = c.answers(1)[0]
        assert got.status == 0 and got.value == legal
        assert c.set(b"bigger", legal + b"v").status == Status.E2BIG
        assert c.set(b"bigger", b"x" * (29 * MIB)).status == Status.E2BIG
        c.send(c.req(Opcode.GET, b"bigger"), c.req(Opcode.NOOP_CLIENT))
        assert [r.status for r in c.answers(2)] == [Status.KEY_ENOENT, 0]       # still open
        huge = bytearray(m.encode(c.req(Opcode.SET, b"huge", extras=bytes(8))))
        huge[8:12] = struct.pack(">I", 30 * MIB)                                # a body above the cap
        c.sock.sendall(bytes(huge))
        with pytest.raises(ConnectionError):
            c.answers(1)
        c.close()
        d = Raw(port)                                                           # the server serves on
        d.send(d.req(Opcode.GET, b"big"))
        assert d.answers(1)[0].value == legal
        d.close()
        # a DCP client takes the document's frame too (a 20 MiB value plus key and extras)
        cap = subprocess.run([DCPTOOL, "capture", f"couchbase://127.0.0.1:{port}/default", "-o",
                              str(tmp_path / "caps"), "--to", "now"], capture_output=True, text=True, timeout=120)
        assert cap.returncode == 0, cap.stderr[-400:]


# --------------------------------------------------------------------------- 9: --schedule

def _schedule(*events: dict) -> str:
    return json.dumps({"seed": None, "nodes": 3, "replicas": 1, "spares": 2, "events": list(events)})


BAD_SCHEDULES = [
    ("two-hard-failovers", _schedule({"at": 10, "kind": "hard-failover", "node": 1, "loss": 0},
                                     {"at": 20, "kind": "hard-failover", "node": 2, "loss": 0}),
     "event at 20 (hard-failover node 2): a failover needs every vbucket to have a replica"),
    ("failover-of-node-0", _schedule({"at": 10, "kind": "graceful-failover", "node": 0}),
     "node 0 (the seed clients bootstrap from) never leaves"),
    ("recovery-of-a-live-node", _schedule({"at": 10, "kind": "delta-recovery", "node": 2}),
     "node 2 is serving: only a node failed over is recovered"),
    ("huge-loss", _schedule({"at": 10, "kind": "restart", "node": 1, "loss": 100_000}),
     "loss 100000 is above --failover-loss 10"),
    ("deep-json", "[" * 100_000 + "]" * 100_000, "JSON nested deeper than 8 levels"),
    ("long-line", " " * (2 << 20), "longer than"),
]


@pytest.mark.parametrize("name,text,says", BAD_SCHEDULES, ids=[b[0] for b in BAD_SCHEDULES])
def test_a_schedule_chaos_would_never_draw_is_refused_before_listening(tmp_path, name, text, says):
    """Every event is checked against what --chaos can draw before the server listens: one
    line, exit 2, no listening line (it used to listen and die mid-stream at the event)."""
    f = tmp_path / "s.json"
    f.write_text(text + "\n")
    res = subprocess.run([DCPTOOL, "serve", "dcp", "--port", "0", "--nodes", "3", "--replicas", "1", "--items", "100",
                          "--schedule", str(f)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""
    assert len(res.stderr.strip().splitlines()) == 1 and says in res.stderr, res.stderr
    assert "recursion" not in res.stderr and "Traceback" not in res.stderr


def test_every_drawn_schedule_is_valid():
    from dcptool.protocol.dcp.server import chaos
    for seed in range(300):
        for nodes, replicas, loss in ((3, 1, 10), (4, 2, 0), (2, 1, 5), (5, 0, 3)):
            chaos.validate(chaos.draw(seed, nodes, replicas, 5000, loss), loss)


# --------------------------------------------------------------------------- 11: out of descriptors

FD_LIMIT = 32                       # the server's RLIMIT_NOFILE: about 10 in use once listening


def _low_fd_limit() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@pytest.mark.integration
def test_out_of_file_descriptors_is_one_warning_line_and_the_server_accepts_again():
    """Issue 36 #11: more connections than the server has descriptors for. asyncio retries the
    accept every second and reported each failure with a traceback (29,388 stderr lines in
    10 s); now one warning line (at most one per 10 s, with a count), and once descriptors free
    up a new connection is served."""
    import threading
    with serving(preexec_fn=_low_fd_limit) as (proc, port):
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
        reader.start()
        held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2 * FD_LIMIT)]
        deadline = time.monotonic() + 30
        while not any("descriptor" in x or "out of system resource" in x for x in lines):
            assert time.monotonic() < deadline, "the server never ran out of descriptors"
            time.sleep(0.05)
        for s in held:
            s.close()
        c = Raw(port)                                   # served once descriptors are free again
        c.send(c.req(Opcode.NOOP_CLIENT))
        assert c.answers(1)[0].status == 0
        c.close()
        proc.terminate()
        proc.wait(30)
        reader.join(10)
    text = "".join(lines)
    assert proc.returncode == 0, text[-2000:]
    assert "Traceback" not in text and "out of system resource" not in text
    warnings = [x for x in lines if "out of file descriptors" in x]
    assert len(lines) <= 3 and len(warnings) >= 1, text[-2000:]
    assert warnings[0].startswith("dcptool: warning: out of file descriptors")


def test_a_snappy_value_announcing_more_than_20_mib_is_e2big_before_inflating():
    """The Snappy preamble (the uncompressed length) is checked first: E2BIG, nothing inflated;
    one announcing exactly 20 MiB that does not decompress is EINVAL."""
    kv = Kv(single())

    def varint(n: int) -> bytes:
        out = bytearray()
        while n >= 0x80:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        return bytes(out + bytes([n]))

    assert kv.upsert(b"z", value=varint(20 * MIB + 1) + b"\x00" * 16, datatype=0x02).status == Status.E2BIG
    assert kv.upsert(b"z", value=varint(20 * MIB) + b"\x00" * 16, datatype=0x02).status == Status.EINVAL
    assert kv.call(Opcode.GET, b"z").status == Status.KEY_ENOENT
