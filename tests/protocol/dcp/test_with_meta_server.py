"""`serve dcp`'s GET_META and writes with meta (protocol/dcp/server/kv_meta.py), sans-IO: the
metadata kept and streamed on DCP, conflict resolution in both bucket modes (seqno, lww),
the options (skip conflict resolution, regenerate CAS, is-expiration, force-accept), ADD
semantics, tombstones, and the statuses of bad requests."""

from __future__ import annotations

import pytest

from dcptool.protocol.dcp.server import kv_meta
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.bucket import vbucket_of
from dcptool.protocol.dcp.server.kv_store import store_of
from dcptool.protocol.dcp.server.manifest import Manifest
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import Feature, Status, WithMetaOption
from dcptool.protocol.dcp.wire.frames import split

WALL = 1_800_000_000.0
JSON_FLAGS = 0x02000006
VBS = 8
FEATURES = (Feature.MUTATION_SEQNO, Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.COLLECTIONS)

SKIP = int(WithMetaOption.SKIP_CONFLICT_RESOLUTION)
REGEN = int(WithMetaOption.REGENERATE_CAS)
FORCE = int(WithMetaOption.FORCE_ACCEPT_WITH_META_OPS)
CAS0 = 0x1800_0000_0000_0000


def single(**kw):
    return P.server_from_options(vbuckets=VBS, items=0, seed=1, manifest=Manifest(1, 2), **kw)


def frames(conn, now=0.0) -> list:
    data = b"".join(bytes(x) for x in conn.pull(now))
    bounds, used = split(data)
    assert used == len(data)
    return [m.decode_bytes(data[o:o + n], conn.collections) for o, n in bounds]


def history(model, key):
    vb = model.buckets["default"].vbuckets[vbucket_of(key, VBS)]
    return [(it.seqno, it.kind, it.rev, it.cas) for it in vb.items() if it.key == key]


class MetaKv:
    """One client connection to a model, with collections, writing with meta."""

    def __init__(self, model, node=0):
        self.conn = model.connect(0.0, node)
        self.opaque = 0
        self.send(m.Hello(features=FEATURES), m.SelectBucket(bucket=b"default"))
        assert [f.status for f in frames(self.conn)] == [0, 0]
        store_of(model.buckets["default"], model).wall_offset = WALL

    def send(self, *msgs, now=0.0):
        self.conn.receive(b"".join(m.encode(x) for x in msgs), now)

    def call(self, opcode, key, *, extras=b"", value=b"", now=0.0) -> m.Message:
        self.opaque += 1
        self.send(m.Request(opcode=opcode, opaque=self.opaque, key=b"\x00" + key, extras=extras, value=value,
                            vbucket=vbucket_of(key, VBS)), now=now)
        return [f for f in frames(self.conn, now) if f.IS_RESPONSE][0]

    def upsert(self, key) -> m.Message:
        return self.call(0x01, key, extras=bytes(8), value=b'{"a":1}')

    def write(self, cls, key, *, rev, cas, flags=JSON_FLAGS, expiry=0, value=b'{"a":1}', options=None,
              header_cas=0, cid=0, datatype=1, now=0.0) -> m.Message:
        self.opaque += 1
        msg = cls(opaque=self.opaque, vbucket=vbucket_of(key, VBS), key=key, collection_id=cid, value=value,
                  datatype=datatype, item_flags=flags, expiration=expiry, rev_seqno=rev, meta_cas=cas,
                  options=options, cas=header_cas)
        self.send(msg, now=now)
        out = [f for f in frames(self.conn, now) if f.IS_RESPONSE]
        assert len(out) == 1
        return out[0]

    def meta(self, key, version=2, now=0.0) -> m.Message:
        self.opaque += 1
        self.send(m.GetMeta(opaque=self.opaque, vbucket=vbucket_of(key, VBS), key=key, collection_id=0,
                            version=version), now=now)
        return [f for f in frames(self.conn, now) if f.IS_RESPONSE][0]


def test_a_write_with_meta_keeps_its_metadata_and_streams_with_it():
    model = single()
    key = b"kept"
    vbid = vbucket_of(key, VBS)
    dcp = model.connect(0.0)
    dcp.receive(b"".join(m.encode(x) for x in (
        m.SelectBucket(opaque=1, bucket=b"default"), m.DcpOpen(opaque=2, name=b"cap", flags=1),
        m.StreamRequest(opaque=3, vbucket=vbid))), 0.0)
    frames(dcp)
    kv = MetaKv(model)
    expiry = int(WALL) + 3600
    w = kv.write(m.SetWithMeta, key, rev=17, cas=CAS0 + 5, flags=0x99, expiry=expiry, value=b'{"v":2}')
    assert w.status == 0 and w.cas == CAS0 + 5
    got = [f for f in frames(dcp) if type(f) is m.Mutation]
    assert [(f.key, f.cas, f.rev_seqno, f.item_flags, f.expiration, f.value) for f in got] == \
        [(key, CAS0 + 5, 17, 0x99, expiry, b'{"v":2}')]
    meta = kv.meta(key)
    assert (meta.deleted, meta.item_flags, meta.expiration, meta.rev_seqno, meta.item_datatype, meta.cas) == \
        (0, 0x99, expiry, 17, 1, CAS0 + 5)
    assert kv.call(0x00, key).cas == CAS0 + 5                        # GET sees the same CAS
    d = kv.write(m.DelWithMeta, key, rev=18, cas=CAS0 + 9, value=b"", flags=0, datatype=0)
    assert d.status == 0 and d.cas == CAS0 + 9
    dels = [f for f in frames(dcp) if type(f) is m.Deletion]
    assert [(f.cas, f.rev_seqno) for f in dels] == [(CAS0 + 9, 18)]
    meta = kv.meta(key, version=None)
    assert (meta.deleted, meta.rev_seqno, meta.item_datatype, meta.cas) == (1, 18, None, CAS0 + 9)
    assert kv.call(0x00, key).status == Status.KEY_ENOENT
    # the vbucket's clock moved past the CAS it was given: a later SET's CAS is above it
    assert kv.upsert(key).cas > CAS0 + 9


@pytest.mark.parametrize("mode,new,wins", [
    ("seqno", (6, 1, 0, 0), True), ("seqno", (4, 99, 0, 0), False), ("seqno", (5, 11, 0, 0), True),
    ("seqno", (5, 9, 0, 0), False), ("seqno", (5, 10, 1, 0), True), ("seqno", (5, 10, 0, 8), True),
    ("seqno", (5, 10, 0, 7), False),
    ("lww", (1, 11, 0, 0), True), ("lww", (99, 9, 0, 0), False), ("lww", (6, 10, 0, 0), True),
    ("lww", (4, 10, 9, 9), False), ("lww", (5, 10, 1, 0), True),
])
def test_conflict_resolution_rule(mode, new, wins):
    # held: rev 5, cas 10, expiry 0, flags 7 (equal everything: the incoming write loses)
    assert kv_meta.incoming_wins(mode, new, (5, 10, 0, 7)) is wins
    assert kv_meta.incoming_wins(mode, (5, 10, 0, 7), (5, 10, 0, 7)) is False


@pytest.mark.parametrize("mode", ["seqno", "lww"])
def test_conflict_resolution_against_the_bucket(mode):
    model = single()
    model.buckets["default"].conflict_resolution = mode
    kv = MetaKv(model)
    opts = FORCE if mode == "lww" else None
    assert kv.write(m.SetWithMeta, b"k", rev=5, cas=CAS0 + 100, options=opts).status == 0
    # higher rev, lower CAS: wins by seqno, loses by lww
    r = kv.write(m.SetWithMeta, b"k", rev=6, cas=CAS0 + 50, value=b'{"b":1}', options=opts)
    assert r.status == (0 if mode == "seqno" else Status.KEY_EEXISTS)
    # lower rev, higher CAS: the other way round
    r = kv.write(m.SetWithMeta, b"k", rev=4, cas=CAS0 + 200, value=b'{"c":1}', options=opts)
    assert r.status == (Status.KEY_EEXISTS if mode == "seqno" else 0)
    # the same metadata again (a second restore): refused, nothing written
    held = history(model, b"k")
    last = held[-1]
    r = kv.write(m.SetWithMeta, b"k", rev=last[2], cas=last[3], options=opts)
    assert r.status == Status.KEY_EEXISTS and history(model, b"k") == held
    # skip conflict resolution: written whatever is held
    r = kv.write(m.SetWithMeta, b"k", rev=1, cas=CAS0 + 1, options=SKIP | (opts or 0))
    assert r.status == 0 and history(model, b"k")[-1][2:] == (1, CAS0 + 1)


def test_lww_bucket_needs_force_accept():
    model = single()
    model.buckets["default"].conflict_resolution = "lww"
    kv = MetaKv(model)
    assert kv.write(m.SetWithMeta, b"k", rev=1, cas=CAS0).status == Status.EINVAL
    assert kv.write(m.SetWithMeta, b"k", rev=1, cas=CAS0, options=FORCE).status == 0


def test_a_tombstone_takes_part_in_conflict_resolution():
    model = single()
    kv = MetaKv(model)
    assert kv.write(m.DelWithMeta, b"never-seen", rev=3, cas=CAS0 + 3, value=b"", datatype=0).status == 0
    assert history(model, b"never-seen") == [(1, "d", 3, CAS0 + 3)]
    assert kv.write(m.SetWithMeta, b"never-seen", rev=2, cas=CAS0 + 9).status == Status.KEY_EEXISTS
    assert kv.write(m.AddWithMeta, b"never-seen", rev=4, cas=CAS0 + 9).status == 0
    assert kv.write(m.AddWithMeta, b"never-seen", rev=9, cas=CAS0 + 99).status == Status.KEY_EEXISTS   # live


def test_options_and_statuses():
    model = single()
    kv = MetaKv(model)
    assert kv.write(m.SetWithMeta, b"k", rev=1, cas=0).status == Status.EINVAL             # no CAS
    assert kv.write(m.SetWithMeta, b"k", rev=1, cas=0, options=REGEN).status == Status.EINVAL   # needs skip
    r = kv.write(m.SetWithMeta, b"k", rev=1, cas=0, options=REGEN | SKIP)
    assert r.status == 0 and r.cas > 0 and history(model, b"k")[-1][2:] == (1, r.cas)
    assert kv.write(m.SetWithMeta, b"k", rev=9, cas=CAS0, header_cas=r.cas + 1).status == Status.KEY_EEXISTS
    assert kv.write(m.SetWithMeta, b"k", rev=9, cas=CAS0, header_cas=r.cas).status == 0
    assert kv.write(m.SetWithMeta, b"nope", rev=9, cas=CAS0, header_cas=5).status == Status.KEY_ENOENT
    assert kv.write(m.SetWithMeta, b"x", rev=1, cas=CAS0, datatype=4).status == Status.NOT_SUPPORTED
    assert kv.write(m.SetWithMeta, b"x", rev=1, cas=CAS0, cid=0x77).status == Status.UNKNOWN_COLLECTION
    assert kv.write(m.SetWithMeta, b"x", rev=1, cas=CAS0, options=0x100).status == Status.EINVAL
    assert kv.write(m.DelWithMeta, b"x", rev=1, cas=CAS0, value=b"body", datatype=0).status == Status.EINVAL
    e = kv.write(m.DelWithMeta, b"k", rev=20, cas=CAS0 + 7, value=b"", datatype=0,
                 options=int(WithMetaOption.IS_EXPIRATION))
    assert e.status == 0 and history(model, b"k")[-1][1:] == ("x", 20, CAS0 + 7)
    assert kv.meta(b"missing").status == Status.KEY_ENOENT
    # a wrong layout (23 extras bytes) is EINVAL, not a dropped connection
    bad = kv.call(0xA2, b"k", extras=bytes(23), value=b"v")
    assert bad.status == Status.EINVAL


def test_not_my_vbucket_on_a_cluster():
    model = P.server_from_options(vbuckets=VBS, items=0, seed=1, nodes=2)
    key = b"routed"
    owner = model.cluster.vbmap[vbucket_of(key, VBS)][0]
    kv = MetaKv(model, node=1 - owner)
    r = kv.write(m.SetWithMeta, key, rev=1, cas=CAS0)
    assert r.status == Status.NOT_MY_VBUCKET and b"vBucketServerMap" in r.value
    assert MetaKv(model, node=owner).write(m.SetWithMeta, key, rev=1, cas=CAS0).status == 0
