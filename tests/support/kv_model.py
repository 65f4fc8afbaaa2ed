"""A KV client on the sans-IO producer (tests of protocol/dcp/server/kv.py): a connection to a
model that says HELLO (collections, JSON, mutation seqnos, durability) and selects the bucket,
then sends requests and reads the answers; the model's wall clock is fixed (WALL)."""

from __future__ import annotations

import struct

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.bucket import vbucket_of
from dcptool.protocol.dcp.server.kv_store import store_of
from dcptool.protocol.dcp.server.manifest import Manifest
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import Feature
from dcptool.protocol.dcp.wire.frames import split

WALL = 1_800_000_000.0          # the wall clock at now = 0 (seconds)
JSON_FLAGS = 0x02000006
FEATURES = (Feature.MUTATION_SEQNO, Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.COLLECTIONS,
            Feature.ALT_REQUEST_SUPPORT, Feature.SYNC_REPLICATION, Feature.SNAPPY)
VBS = 8


def frames(conn, now=0.0) -> list:
    data = b"".join(bytes(x) for x in conn.pull(now))
    bounds, used = split(data)
    assert used == len(data)
    return [m.decode_bytes(data[o:o + n], conn.collections) for o, n in bounds]


class Kv:
    """One client connection to a model, speaking KV with collections."""

    def __init__(self, model, node=0, features=FEATURES):
        self.model = model
        self.conn = model.connect(0.0, node)
        self.opaque = 0
        self.send(m.Hello(features=features), m.SelectBucket(bucket=b"default"))
        assert [f.status for f in frames(self.conn)] == [0, 0]
        store_of(model.buckets["default"], model).wall_offset = WALL

    def send(self, *msgs, now=0.0):
        self.conn.receive(b"".join(m.encode(x) for x in msgs), now)

    def req(self, opcode, key=b"", *, extras=b"", value=b"", cas=0, cid=0, vb=None, durability=None,
            datatype=0, raw_key=None) -> m.Request:
        self.opaque += 1
        full = raw_key if raw_key is not None else (bytes([cid]) + key if key else b"")
        infos = ((1, bytes([durability])),) if durability is not None else ()
        return m.Request(opcode=opcode, opaque=self.opaque, key=full, extras=extras, value=value, cas=cas,
                         vbucket=vbucket_of(key, VBS) if vb is None else vb, frame_infos=infos,
                         datatype=datatype)

    def call(self, opcode, key=b"", now=0.0, **kw) -> m.Response:
        self.send(self.req(opcode, key, **kw), now=now)
        out = [f for f in frames(self.conn, now) if f.IS_RESPONSE]
        assert len(out) == 1, out
        return out[0]

    def upsert(self, key, value=b'{"a":1}', flags=JSON_FLAGS, expiry=0, op=0x01, **kw):
        return self.call(op, key, extras=struct.pack(">II", flags, expiry), value=value, **kw)

    def durable(self, key, level=1, value=b'{"d":1}') -> m.Response:
        """A durable upsert: no answer until the connection's next tick (the commit)."""
        self.send(self.req(0x01, key, extras=struct.pack(">II", JSON_FLAGS, 0), value=value, durability=level))
        assert [f for f in frames(self.conn) if f.IS_RESPONSE] == []
        self.conn.tick(0.0)
        out = [f for f in frames(self.conn) if f.IS_RESPONSE]
        assert len(out) == 1
        return out[0]


def single(**kw):
    return P.server_from_options(vbuckets=VBS, items=0, seed=1, manifest=Manifest(1, 2), **kw)


def history(model, key):
    vb = model.buckets["default"].vbuckets[vbucket_of(key, VBS)]
    return [(it.seqno, it.kind, it.rev, it.cas) for it in vb.items() if it.key == key]
