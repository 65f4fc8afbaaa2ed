"""Issue 36, the KV side of `serve dcp` (findings 5, 6, 7, 9 and 11): what one connection may
have queued is bounded, durability is honoured by every write command that takes it, a
legal 20 MiB value is stored and a larger one is E2BIG on an open connection, a schedule
is checked before listening, and running out of file descriptors is one warning line."""

from __future__ import annotations

import struct

import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.bucket import vbucket_of
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import Opcode, Status
from tests.protocol.dcp.test_kv import JSON_FLAGS, VBS, Kv, frames, history, single

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
