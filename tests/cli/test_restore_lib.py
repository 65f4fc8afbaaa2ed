"""The pieces of `dcptool restore` without a server: the expiry rule (skip and count, or
--replace-ttl), --collection-map parsing and checking against the target's manifest, --keys
(glob or /regex/), what each answer status means, and the SET/DEL_WITH_META frames a document
becomes (options: force-accept always, skip conflict resolution with --force, is-expiration)."""

from __future__ import annotations

import pytest

from dcptool.protocol.dcp.client import kv_writer as W
from dcptool.protocol.dcp.client.manifest import Manifest
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import Status, WithMetaOption
from dcptool.restore import run as R
from dcptool.restore.documents import Captured, key_matcher

NOW = 1_800_000_000


def _doc(key=b"k", expiry=0, deleted=False, cid=0, expired=False):
    return W.Doc(key=key, collection_id=cid, rev_seqno=3, cas=99, flags=7, expiry=expiry, datatype=1,
                 deleted=deleted, value=b"" if deleted else b'{"a":1}', expired=expired)


def test_a_passed_expiry_is_skipped_and_counted_or_replaced():
    docs = [Captured(_doc(b"a", NOW - 1), 0), Captured(_doc(b"b", NOW + 60), 0), Captured(_doc(b"c"), 0),
            Captured(_doc(b"d", NOW - 5, deleted=True), 0)]
    opts = R.RestoreOptions(files=[], seeds=[], bucket="b", now=lambda: NOW)
    counts = R.RestoreCounts()
    kept = list(R.prepared(opts, docs, {}, counts))
    assert [d.key for d in kept] == [b"b", b"c", b"d"] and counts.expired == 1 and counts.documents == 4
    opts.replace_ttl = True
    kept = list(R.prepared(opts, docs, {}, R.RestoreCounts()))
    assert [(d.key, d.expiry) for d in kept][0] == (b"a", 0)


def test_collection_map_parsing_and_the_target_manifest():
    assert R.parse_collection_map(["a.b=c.d"]) == {"a.b": "c.d"}
    for bad in ("a.b", "a=b.c", "a.b=c", ".b=c.d"):
        with pytest.raises(ValueError):
            R.parse_collection_map([bad])
    man = Manifest(5, {"_default": (0, {"_default": 0}), "inv": (8, {"hotel": 8, "route": 9})})
    assert R.target_ids(man, {"inv.hotel": "inv.route"}, None, {0, 8}) == {8: 9, 0: 0}
    with pytest.raises(R.UnknownTargetCollection, match="nope.x"):
        R.target_ids(man, {"inv.hotel": "nope.x"}, None, {8})
    with pytest.raises(R.UnknownTargetCollection, match="0x20"):
        R.target_ids(man, {}, None, {0x20})


@pytest.mark.parametrize("pattern,key,hit", [
    ("user-*", "user-1", True), ("user-*", "order-1", False), ("/^o.*-[0-9]$/", "order-1", True),
    ("/^o.*-[0-9]$/", "user-1", False), (None, "x", True),
])
def test_keys_glob_or_regex(pattern, key, hit):
    match = key_matcher(pattern)
    assert (match is None or match(key)) is hit


def test_verdicts():
    assert W.verdict(Status.SUCCESS) is W.Verdict.WRITTEN
    assert W.verdict(Status.KEY_EEXISTS) is W.Verdict.SKIPPED
    assert W.verdict(Status.NOT_MY_VBUCKET) is W.Verdict.REROUTE
    assert W.verdict(Status.ETMPFAIL) is W.Verdict.RETRY
    assert W.verdict(Status.EINVAL) is W.Verdict.FAILED


def test_the_frames_a_document_becomes():
    msg = m.decode_bytes(W.write_frame(_doc(cid=8), vbucket=5, opaque=9, force=False, collections=True), True)
    assert isinstance(msg, m.SetWithMeta) and not isinstance(msg, m.DelWithMeta)
    assert (msg.vbucket, msg.opaque, msg.key, msg.collection_id, msg.rev_seqno, msg.meta_cas, msg.item_flags,
            msg.datatype, msg.value) == (5, 9, b"k", 8, 3, 99, 7, 1, b'{"a":1}')
    assert msg.options == WithMetaOption.FORCE_ACCEPT_WITH_META_OPS
    forced = m.decode_bytes(W.write_frame(_doc(), vbucket=5, opaque=1, force=True, collections=False))
    assert forced.options & WithMetaOption.SKIP_CONFLICT_RESOLUTION and forced.key == b"k"
    gone = m.decode_bytes(W.write_frame(_doc(deleted=True, expired=True), vbucket=1, opaque=1, force=False,
                                        collections=False))
    assert isinstance(gone, m.DelWithMeta) and gone.options & WithMetaOption.IS_EXPIRATION and gone.value == b""


def test_vbucket_of_is_couchbases_crc32():
    from dcptool.protocol.dcp.server.bucket import vbucket_of
    for key in (b"a", b"doc-0001", b"user::42"):
        assert W.vbucket_of(key, 1024) == vbucket_of(key, 1024) and W.vbucket_of(key, 64) == vbucket_of(key, 64)


@pytest.mark.parametrize("deleted,expired,force,collections", [
    (False, False, False, True), (False, False, True, False), (True, False, False, True), (True, True, True, True),
])
def test_the_packed_frame_is_the_codecs(deleted, expired, force, collections):
    doc = _doc(key=b"user::7", deleted=deleted, cid=0x88, expired=expired)
    kw = {"vbucket": 1023, "opaque": 0xDEADBEEF, "force": force, "collections": collections}
    assert W.write_frame(doc, **kw) == m.encode(W.write_message(doc, **kw))


class _Target:
    """A stand-in for the cluster's pump: every write is accepted at once."""

    def __init__(self):
        self.keys = []

    def start_pump(self, done, failed):
        self.done = done

    def submit(self, docs):
        for doc in docs:
            self.keys.append(doc.key)
            self.done(doc, W.Verdict.WRITTEN, 0)

    async def room(self, limit):
        return None


def _write(batches, inflight=4):
    import asyncio
    target, counts = _Target(), R.RestoreCounts()
    opts = R.RestoreOptions(files=[], seeds=[], bucket="b", inflight=inflight, now=lambda: NOW)

    async def run():
        slices = ([c.doc for c in batch] for batch in batches)
        await asyncio.wait_for(R._write_all(target, slices, {0: 0}, opts, counts, asyncio.Event(), lambda c: None),
                               timeout=20)
    asyncio.run(run())
    return target, counts


def test_every_document_of_every_batch_is_written():
    batches = iter([[Captured(_doc(b"k%d" % i), 0) for i in range(j, j + 10)] for j in range(0, 50, 10)])
    target, counts = _write(batches)
    assert sorted(target.keys) == sorted(b"k%d" % i for i in range(50)) and counts.written == 50


def test_a_capture_that_fails_while_read_ends_the_restore_with_its_error():
    # reading the capture's documents failing after the first batch (a plan error in DuckDB,
    # a damaged segment): the restore raises that error; it hung before, the writers waiting
    # on an empty queue for a feeder that had died
    class PlanError(Exception):
        pass

    def batches():
        yield [Captured(_doc(b"a"), 0), Captured(_doc(b"b"), 0)]
        raise PlanError("Binder Error: no function value_of")
    with pytest.raises(PlanError, match="value_of"):
        _write(batches())
