"""KV on the sans-IO producer (protocol/dcp/server/kv.py, kv_store.py): Couchbase's status
codes for bad and conflicting requests, kv_engine's seqno / CAS (hybrid logical clock) /
rev seqno rules, expiry on read and by the pager, durable writes (prepare, commit at the
next tick, SYNC_WRITE_IN_PROGRESS in between, DURABILITY_IMPOSSIBLE without a majority),
writes live on an open DCP stream, and no acknowledged durable write lost by a failover."""

from __future__ import annotations

import json
import struct

import cramjam

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.bucket import vbucket_of
from dcptool.protocol.dcp.server.manifest import Manifest
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import Status
from tests.support.kv_model import (
    JSON_FLAGS,
    VBS,
    WALL,
    Kv,
    frames,
    history,
    single,
)

# --------------------------------------------------------------------------- statuses

def test_status_codes_of_bad_and_conflicting_requests():
    model = single()
    kv = Kv(model)
    assert kv.call(0x00, b"nope").status == Status.KEY_ENOENT
    assert kv.upsert(b"k", op=0x03).status == Status.KEY_ENOENT                  # replace: missing
    assert kv.upsert(b"k", op=0x02).status == Status.SUCCESS                     # insert
    assert kv.upsert(b"k", op=0x02).status == Status.KEY_EEXISTS                 # insert: exists
    cas = kv.call(0x00, b"k").cas
    assert kv.upsert(b"k", op=0x03, cas=cas + 1).status == Status.KEY_EEXISTS    # stale CAS
    assert kv.call(0x04, b"k", cas=cas + 1).status == Status.KEY_EEXISTS
    assert kv.upsert(b"k", op=0x02, cas=cas).status == Status.EINVAL              # insert takes no CAS
    assert kv.upsert(b"gone", cas=5).status == Status.KEY_ENOENT                  # upsert with CAS: missing
    assert kv.call(0x04, b"gone").status == Status.KEY_ENOENT
    assert kv.call(0x1C, b"gone", extras=b"\0\0\0\1").status == Status.KEY_ENOENT
    # layouts: extras, keys, datatypes
    assert kv.call(0x01, b"k", extras=b"\0" * 4, value=b"1").status == Status.EINVAL
    assert kv.call(0x00, b"k", extras=b"\0").status == Status.EINVAL
    assert kv.call(0x00, raw_key=b"\x00", vb=0).status == Status.EINVAL           # no key after the prefix
    assert kv.call(0x00, raw_key=b"\x80", vb=0).status == Status.EINVAL           # a prefix that never ends
    assert kv.call(0x00, b"x" * 251).status == Status.EINVAL
    assert kv.upsert(b"k", value=b"\x01\x02", datatype=0x02).status == Status.EINVAL   # not Snappy
    # collections: the manifest uid in the body of UNKNOWN_COLLECTION
    rsp = kv.call(0x00, b"k", cid=0x55)
    assert rsp.status == Status.UNKNOWN_COLLECTION and json.loads(rsp.value) == {"manifest_uid": "1"}
    assert kv.call(0xBB, value=b"inventory.airline").extras == struct.pack(">QI", 1, 8)
    assert kv.call(0xBB, value=b"inventory.nope").status == Status.UNKNOWN_COLLECTION
    assert kv.call(0xBB, value=b"nope.airline").status == Status.UNKNOWN_SCOPE
    assert kv.upsert(b"k", cid=8).status == Status.SUCCESS
    # durability: the level must be known; one node cannot make a majority
    assert kv.upsert(b"d", durability=0).status == Status.DURABILITY_INVALID_LEVEL
    assert kv.upsert(b"d", durability=4).status == Status.DURABILITY_INVALID_LEVEL
    assert kv.upsert(b"d", durability=1).status == Status.DURABILITY_IMPOSSIBLE
    # a command serve dcp does not know: UNKNOWN_COMMAND, and the connection stays
    assert kv.call(0xD0, b"k", extras=b"\0").status == Status.UNKNOWN_COMMAND   # sub-document lookup
    assert kv.call(0x0A).status == Status.SUCCESS and kv.conn.closed is None


def test_snappy_values_are_stored_decompressed_and_json_is_detected():
    kv = Kv(single())
    doc = b'{"long":"' + b"z" * 200 + b'"}'
    assert kv.upsert(b"s", value=bytes(cramjam.snappy.compress_raw(doc)), datatype=0x02).status == 0
    got = kv.call(0x00, b"s")
    assert (got.value, got.datatype, got.extras) == (doc, 1, struct.pack(">I", JSON_FLAGS))
    kv.upsert(b"b", value=b"\xff\x00binary", flags=0x03000000)
    assert kv.call(0x00, b"b").datatype == 0


def test_not_my_vbucket_carries_the_map_and_replicas_answer_get_replica():
    model = P.server_from_options(vbuckets=VBS, items=0, seed=1, nodes=3, replicas=1)
    cl = model.cluster
    key = b"routed"
    vb = vbucket_of(key, VBS)
    active, replica = cl.vbmap[vb][0], cl.vbmap[vb][1]
    other = next(n for n in range(3) if n not in (active, replica))
    wrong = Kv(model, node=other)
    rsp = wrong.upsert(key)
    assert rsp.status == Status.NOT_MY_VBUCKET and json.loads(rsp.value)["vBucketServerMap"]
    assert wrong.call(0x00, key, vb=VBS + 3).status == Status.NOT_MY_VBUCKET
    assert Kv(model, node=active).upsert(key).status == Status.SUCCESS
    assert Kv(model, node=active).call(0x83, key).status == Status.NOT_MY_VBUCKET
    assert Kv(model, node=replica).call(0x83, key).value == b'{"a":1}'


# --------------------------------------------------------------------------- seqno, CAS, rev

def test_seqnos_revs_and_the_hybrid_logical_clock():
    model = single()
    kv = Kv(model)
    wall_ns = int(WALL * 1e9) & ~0xFFFF
    a = kv.upsert(b"k")
    b = kv.upsert(b"k")                            # same wall clock: the counter moves
    assert (a.cas, b.cas) == (wall_ns, wall_ns + 1)
    uuid = model.buckets["default"].vbuckets[vbucket_of(b"k", VBS)].uuid
    assert struct.unpack(">QQ", b.extras) == (uuid, 2)          # MUTATION_SEQNO: uuid, seqno
    c = kv.call(0x04, b"k", now=2.0, cas=b.cas)                 # later: the clock jumps
    assert c.cas == int((WALL + 2.0) * 1e9) & ~0xFFFF
    d = kv.upsert(b"k", op=0x02, now=2.0)                        # insert over the tombstone
    assert d.status == 0 and d.cas == c.cas + 1
    assert history(model, b"k") == [(1, "m", 1, a.cas), (2, "m", 2, b.cas), (3, "d", 3, c.cas),
                                    (4, "m", 4, d.cas)]
    assert kv.call(0x00, b"k", now=2.0).cas == d.cas
    # GET_META (exists): rev seqno and deleted flag, tombstones included
    kv.call(0x04, b"k", now=2.0)
    meta = kv.call(0xA0, b"k", now=2.0, extras=b"\x02")
    assert (meta.deleted, meta.rev_seqno) == (1, 5)
    # a vbucket's clock never goes back, even when the wall clock does
    e = kv.upsert(b"k", now=-100.0)
    assert e.cas > meta.cas
    # CAS of a replace must be the current one; the right one works
    assert kv.upsert(b"k", op=0x03, cas=e.cas, now=-100.0).status == 0


def test_touch_and_get_and_touch_make_new_versions():
    model = single()
    kv = Kv(model)
    w = kv.upsert(b"t", value=b'{"v":1}')
    t = kv.call(0x1C, b"t", extras=struct.pack(">I", 100))
    assert t.status == 0 and t.cas > w.cas and not t.value
    g = kv.call(0x1D, b"t", extras=struct.pack(">I", 200))
    assert (g.value, g.extras) == (b'{"v":1}', struct.pack(">I", JSON_FLAGS)) and g.cas > t.cas
    vb = model.buckets["default"].vbuckets[vbucket_of(b"t", VBS)]
    last = vb.mem[-1]
    assert (last.seqno, last.rev, last.expiry, last.flags) == (3, 3, int(WALL) + 200, JSON_FLAGS)
    absolute = int(WALL) + 31 * 24 * 3600
    kv.call(0x1C, b"t", extras=struct.pack(">I", absolute))
    assert vb.mem[-1].expiry == absolute


# --------------------------------------------------------------------------- expiry

def test_an_expired_document_read_is_deleted_and_the_pager_expires_the_rest():
    model = single()
    model.expiry_pager = 5.0
    kv = Kv(model)
    kv.upsert(b"e1", expiry=10)
    kv.upsert(b"e2", expiry=10)
    kv.upsert(b"keep")
    assert kv.call(0x00, b"e1", now=9.0).status == 0
    assert kv.call(0x00, b"e1", now=10.5).status == Status.KEY_ENOENT
    assert [h[1] for h in history(model, b"e1")] == ["m", "x"]
    assert [h[1] for h in history(model, b"e2")] == ["m"]        # nobody read it yet
    assert kv.conn.next_deadline() is not None                   # the pager is due on its own
    kv.conn.tick(11.0)
    kv.conn.tick(100.0)
    assert [h[1] for h in history(model, b"e2")] == ["m", "x"]
    assert [h[1] for h in history(model, b"keep")] == ["m"]
    assert kv.upsert(b"e1", op=0x02, now=100.0).status == 0     # insert over the expired one
    assert history(model, b"e1")[-1][2] == 3                      # rev after the expiration


# --------------------------------------------------------------------------- durable writes

def test_durable_writes_prepare_then_commit_and_block_the_key_meanwhile():
    model = P.server_from_options(vbuckets=VBS, items=0, seed=1, nodes=3, replicas=1)
    key = b"dur"
    vb = vbucket_of(key, VBS)
    kv = Kv(model, node=model.cluster.vbmap[vb][0])
    kv.send(kv.req(0x01, key, extras=struct.pack(">II", JSON_FLAGS, 0), value=b'{"d":1}', durability=1),
            kv.req(0x01, key, extras=struct.pack(">II", JSON_FLAGS, 0), value=b'{"d":2}'))
    out = [f for f in frames(kv.conn) if f.IS_RESPONSE]
    assert [f.status for f in out] == [Status.SYNC_WRITE_IN_PROGRESS]   # the durable one waits
    assert [h[1] for h in history(model, key)] == ["p"]
    assert kv.conn.next_deadline() is not None
    kv.conn.tick(0.0)
    out = [f for f in frames(kv.conn) if f.IS_RESPONSE]
    hist = history(model, key)
    assert [h[1] for h in hist] == ["p", "c"] and out[0].status == 0 and out[0].cas == hist[0][3]
    assert kv.call(0x00, key).value == b'{"d":1}'
    for level in (2, 3):
        assert kv.durable(key, level).status == 0
    assert [h[1] for h in history(model, key)] == ["p", "c"] * 3


def test_failover_loses_only_non_durable_writes():
    model = P.server_from_options(vbuckets=VBS, items=0, seed=1, nodes=3, replicas=1)
    key = b"dur"
    vb = model.buckets["default"].vbuckets[vbucket_of(key, VBS)]
    active = model.cluster.vbmap[vb.vbid][0]
    kv = Kv(model, node=active)
    for i in range(5):
        kv.upsert(b"dur", value=b'{"i":%d}' % i)
    assert kv.durable(key, value=b'{"durable":true}').status == 0
    durable_high = vb.high_seqno
    lost = [kv.upsert(key, value=b'{"after":%d}' % i).cas for i in range(3)]
    model.apply_changes([model.cluster.fail_over(active, 100)])   # a replica 100 seqnos behind
    assert vb.high_seqno == durable_high                            # the durable write stays
    assert not any(it.cas in lost for it in vb.items())             # later writes are lost, not rewritten
    new = Kv(model, node=model.cluster.vbmap[vb.vbid][0])
    assert new.call(0x00, key).value == b'{"durable":true}'


def test_durability_needs_a_live_majority():
    model = P.server_from_options(vbuckets=VBS, items=0, seed=1, nodes=2, replicas=1)
    key = b"maj"
    vbid = vbucket_of(key, VBS)
    row = model.cluster.vbmap[vbid]
    kv = Kv(model, node=row[0])
    assert kv.durable(key).status == 0
    model.apply_changes([model.cluster.fail_over(row[1], 0)])       # the replica's node is gone
    assert kv.upsert(key, durability=1).status == Status.DURABILITY_IMPOSSIBLE
    assert kv.upsert(key).status == 0


# --------------------------------------------------------------------------- streams

def test_a_write_is_live_on_an_open_stream():
    model = single()
    key = b"live"
    vbid = vbucket_of(key, VBS)
    dcp = model.connect(0.0)
    dcp.receive(b"".join(m.encode(x) for x in (
        m.SelectBucket(opaque=1, bucket=b"default"), m.DcpOpen(opaque=2, name=b"cap", flags=1),
        m.StreamRequest(opaque=3, vbucket=vbid))), 0.0)
    assert [f.status for f in frames(dcp)] == [0, 0, 0]
    kv = Kv(model)
    w = kv.upsert(key, value=b'{"x":1}', expiry=60)
    got = [f for f in frames(dcp) if type(f) is m.Mutation]
    assert [(f.key, f.cas, f.by_seqno, f.rev_seqno, f.item_flags, f.expiration, f.value) for f in got] == \
        [(key, w.cas, 1, 1, JSON_FLAGS, int(WALL) + 60, b'{"x":1}')]
    kv.call(0x04, key)
    assert [type(f).__name__ for f in frames(dcp) if not f.IS_RESPONSE][-1] == "Deletion"


def test_a_durable_write_completes_when_its_client_goes_away():
    model = P.server_from_options(vbuckets=VBS, items=0, seed=1, nodes=3, replicas=1)
    key = b"orphan"
    node = model.cluster.vbmap[vbucket_of(key, VBS)][0]
    kv = Kv(model, node=node)
    kv.send(kv.req(0x01, key, extras=bytes(8), value=b'{"o":1}', durability=1))
    kv.conn.close("client disconnected")
    assert [h[1] for h in history(model, key)] == ["p", "c"]
    assert Kv(model, node=node).upsert(key).status == 0      # the key is not blocked


# --------------------------------------------------------------------------- hostile requests

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hs

from dcptool.protocol.dcp.server import kv as KV  # noqa: E402

_requests = hs.builds(
    dict, opcode=hs.sampled_from(sorted(KV.OPCODES)), key=hs.binary(max_size=300),
    extras=hs.one_of(hs.binary(max_size=12), hs.sampled_from([b"", bytes(4), bytes(8)])),
    value=hs.binary(max_size=64), cas=hs.one_of(hs.just(0), hs.integers(0, (1 << 64) - 1)),
    datatype=hs.integers(0, 255), vbucket=hs.integers(0, 0xFFFF),
    frame_infos=hs.one_of(hs.just(()), hs.tuples(hs.tuples(hs.just(1), hs.binary(max_size=4)))))


@settings(derandomize=True, max_examples=300, deadline=None)
@given(hs.lists(_requests, min_size=1, max_size=8))
def test_any_kv_request_gets_one_answer_and_the_connection_stays(reqs):
    model = P.server_from_options(vbuckets=VBS, items=20, seed=2, nodes=2, replicas=1, manifest=Manifest(1, 2))
    kv = Kv(model)
    msgs = [m.Request(opaque=i + 1, **r) for i, r in enumerate(reqs)]
    kv.send(*msgs)
    kv.conn.tick(0.0)                      # durable writes answer at the tick
    out = [f for f in frames(kv.conn) if f.IS_RESPONSE]
    assert kv.conn.closed is None
    assert sorted(f.opaque for f in out) == list(range(1, len(reqs) + 1))
    assert all(f.status != Status.UNKNOWN_COMMAND for f in out)


def test_counters_and_append_prepend():
    model = single()
    kv = Kv(model)
    ctr = lambda op, delta, initial=0, expiry=0, **kw: kv.call(op, b"c", extras=struct.pack(">QQI", delta, initial,
                                                                                        expiry), **kw)
    assert ctr(0x05, 1, 10, 0xFFFFFFFF).status == Status.KEY_ENOENT     # no create
    first = ctr(0x05, 1, 10)
    assert (first.status, struct.unpack(">Q", first.value)[0]) == (0, 10)   # created with the initial
    assert struct.unpack(">Q", ctr(0x05, 5).value)[0] == 15
    assert struct.unpack(">Q", ctr(0x06, 100).value)[0] == 0               # decrement stops at 0
    assert struct.unpack(">Q", ctr(0x05, (1 << 64) - 1).value)[0] == (1 << 64) - 1
    assert struct.unpack(">Q", ctr(0x05, 2).value)[0] == 1                 # increment wraps
    assert kv.call(0x00, b"c").value == b"1"
    assert [h[2] for h in history(model, b"c")] == [1, 2, 3, 4, 5]
    kv.upsert(b"s", value=b'"ab"')
    assert kv.call(0x05, b"s", extras=struct.pack(">QQI", 1, 0, 0)).status == Status.DELTA_BADVAL
    assert kv.call(0x0E, b"nope", value=b"x").status == Status.NOT_STORED
    kv.upsert(b"t", value=b"mid", flags=0x03000000)
    assert kv.call(0x0E, b"t", value=b"-end").status == 0
    assert kv.call(0x0F, b"t", value=b"start-").status == 0
    got = kv.call(0x00, b"t")
    assert (got.value, got.extras) == (b"start-mid-end", struct.pack(">I", 0x03000000))
    assert kv.call(0x0E, b"t", value=b"x", cas=got.cas + 1).status == Status.KEY_EEXISTS


def test_get_and_lock_then_only_the_lock_cas_writes_or_unlocks():
    model = single()
    kv = Kv(model)
    w = kv.upsert(b"l")
    high = model.buckets["default"].vbuckets[vbucket_of(b"l", VBS)].high_seqno
    got = kv.call(0x94, b"l", extras=struct.pack(">I", 10))
    assert got.status == 0 and got.cas > w.cas and got.value == b'{"a":1}'
    assert model.buckets["default"].vbuckets[vbucket_of(b"l", VBS)].high_seqno == high   # no change streamed
    assert kv.call(0x00, b"l").cas == 0xFFFFFFFFFFFFFFFF                  # locked: CAS -1
    assert kv.call(0x94, b"l", extras=struct.pack(">I", 10)).status == Status.LOCKED
    assert kv.upsert(b"l").status == Status.LOCKED
    assert kv.upsert(b"l", cas=w.cas).status == Status.LOCKED
    assert kv.call(0x04, b"l").status == Status.LOCKED
    assert kv.call(0x95, b"l", cas=w.cas).status == Status.LOCKED         # the wrong CAS
    assert kv.call(0x95, b"l", cas=got.cas).status == 0
    assert kv.call(0x95, b"l", cas=got.cas).status == Status.NOT_LOCKED
    assert kv.call(0x00, b"l").cas == w.cas                               # unlocked: its own CAS again
    # a write with the lock CAS unlocks; a lock ends on its own after its time
    lock = kv.call(0x94, b"l", extras=struct.pack(">I", 5)).cas
    assert kv.upsert(b"l", cas=lock, value=b'{"b":2}').status == 0
    assert kv.call(0x00, b"l").cas != 0xFFFFFFFFFFFFFFFF
    kv.call(0x94, b"l", extras=struct.pack(">I", 5))
    assert kv.upsert(b"l", now=4.0).status == Status.LOCKED
    assert kv.upsert(b"l", now=5.5).status == 0
    assert kv.call(0x94, b"nope", extras=bytes(4)).status == Status.KEY_ENOENT


def test_a_kv_mutation_frame_is_the_codec_s():
    """streams.encode_item packs a mutation at once: the same bytes as m.encode(m.Mutation)."""
    import types

    from dcptool.protocol.dcp.server.bucket import Item
    from dcptool.protocol.dcp.server.streams import encode_item
    from dcptool.protocol.dcp.wire import messages as wm
    for cid, json_on, no_value in ((None, True, False), (8, True, False), (0, False, False), (None, True, True)):
        c = types.SimpleNamespace(collections=cid is not None, no_value=no_value, json=json_on, compress=False,
                                  sync_writes=False, delete_times=False, controls={})
        it = Item(77, b"key-\xc3\xa9", b'{"a":1}', 5, 0x1234567890ABCDEF, "m", 1, cid=cid or 0, flags=0xDEADBEEF,
                  expiry=1_800_000_000)
        want = wm.encode(wm.Mutation(vbucket=513, opaque=0xF00D, cas=it.cas, datatype=1 if json_on and not no_value else 0,
                                     key=it.key, collection_id=cid if cid is not None else None,
                                     value=b"" if no_value else it.value, by_seqno=77, rev_seqno=5,
                                     item_flags=it.flags, expiration=it.expiry))
        assert encode_item(c, 513, 0xF00D, it) == want
