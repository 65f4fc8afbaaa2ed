"""The restore's pump (protocol/transport/kv_restore.py KvCluster.submit): documents queued on
their owner's link and written with the window kept full, and what it hands to the
per-document path: a temporary status (written again after a wait) and a link that closes
with writes in flight or queued (written again on a new link, none lost, none counted twice).
The target is a scripted single node on this event loop (no map: every vbucket is its);
NOT_MY_VBUCKET with a newer map is tests/cli/test_restore.py's rebalance. Also the batch
encoder against the per-document one, and the rows of the plan made documents."""

from __future__ import annotations

import asyncio

import pytest

from dcptool.protocol.dcp.client import kv_writer as W
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import Opcode, Status
from dcptool.protocol.dcp.wire.frames import FrameParser
from dcptool.protocol.transport.kv_restore import KvCluster
from dcptool.restore import documents as D
from dcptool.restore import run as R

VBS = 8
WITH_META = (Opcode.SET_WITH_META, Opcode.DEL_WITH_META)


class Node:
    """A KV node that answers the handshake, lists VBS vbuckets, and answers each write with
    meta as `script(key, attempt)` says: a status, or "close" (the connection dropped with
    that write and every later one of the connection unanswered)."""

    def __init__(self, script):
        self.script = script
        self.attempts: dict[bytes, int] = {}
        self.held: dict[bytes, bytes] = {}       # key -> value written
        self.connections = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        parser = FrameParser()
        try:
            while data := await reader.read(1 << 16):
                out = []
                for fr in parser.feed(data):
                    answer = self._answer(m.decode(fr, True))
                    if answer is None:
                        writer.close()
                        return
                    out.append(answer)
                writer.write(b"".join(out))
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _answer(self, req) -> bytes | None:
        rsp = lambda status=0, **kw: m.encode(m.Response(opcode=req.op_code, opaque=req.opaque, status=status, **kw))  # noqa: E731
        if req.op_code == Opcode.HELLO:
            return m.encode(m.HelloResponse(opaque=req.opaque, features=tuple(req.features)))
        if req.op_code == Opcode.GET_ALL_VB_SEQNOS:
            return m.encode(m.GetAllVbSeqnosResponse(opaque=req.opaque, seqnos=tuple((vb, 0) for vb in range(VBS))))
        if req.op_code in (Opcode.GET_CLUSTER_CONFIG, Opcode.GET_COLLECTIONS_MANIFEST):
            return rsp(Status.KEY_ENOENT)
        if req.op_code not in WITH_META:
            return rsp()
        attempt = self.attempts[req.key] = self.attempts.get(req.key, 0) + 1
        status = self.script(req.key, attempt)
        if status == "close":
            return None
        if status == Status.SUCCESS:
            self.held[req.key] = req.value
        return rsp(status)


def _docs(n: int) -> list[W.Doc]:
    return [W.Doc(key=b"doc-%04d" % i, collection_id=0, rev_seqno=1 + i % 3, cas=1000 + i, flags=i, expiry=0,
                  datatype=1, deleted=False, value=b'{"i":%d}' % i) for i in range(n)]


def _restore(node: Node, docs: list[W.Doc], window: int = 4) -> R.RestoreCounts:
    async def run():
        port = await node.start()
        cluster = KvCluster([("127.0.0.1", port)], "default", None, None, window=window, timeout=20)
        counts = R.RestoreCounts()
        opts = R.RestoreOptions(files=[], seeds=[], bucket="default", inflight=16)
        try:
            await cluster.connect()
            await cluster.open_links()
            slices = iter([docs[i:i + 25] for i in range(0, len(docs), 25)])
            await asyncio.wait_for(R._write_all(cluster, slices, {0: 0}, opts, counts, asyncio.Event(),
                                                lambda c: None), 30)
        finally:
            await cluster.close()
            node.server.close()
        return counts
    return asyncio.run(run())


def test_every_document_is_written_once_through_the_window():
    node = Node(lambda key, attempt: Status.SUCCESS)
    docs = _docs(100)
    counts = _restore(node, docs)
    assert counts.written == 100 and counts.failed == 0 and counts.skipped == 0
    assert node.held == {d.key: d.value for d in docs} and set(node.attempts.values()) == {1}


def test_a_temporary_status_is_written_again_and_a_newer_version_is_skipped():
    def script(key, attempt):
        i = int(key[-4:])
        if i % 5 == 0 and attempt == 1:
            return Status.ETMPFAIL
        return Status.KEY_EEXISTS if i % 7 == 0 else Status.SUCCESS
    node = Node(script)
    counts = _restore(node, _docs(60))
    skipped = {i for i in range(60) if i % 7 == 0}
    assert counts.skipped == len(skipped) and counts.written == 60 - len(skipped) and counts.failed == 0
    assert {int(k[-4:]) for k, n in node.attempts.items() if n == 2} == {i for i in range(60) if i % 5 == 0}


def test_a_link_that_closes_with_writes_in_flight_loses_none():
    # the first connection drops at the 30th write: the writes in flight and queued on it
    # go to the per-document path, which opens a new link
    state = {"seen": 0}

    def script(key, attempt):
        state["seen"] += 1
        return "close" if state["seen"] == 30 else Status.SUCCESS
    node = Node(script)
    docs = _docs(80)
    counts = _restore(node, docs)
    assert counts.written == 80 and counts.failed == 0 and counts.documents == 80
    assert node.held == {d.key: d.value for d in docs} and node.connections >= 2


def test_a_refused_write_is_counted_with_its_status():
    node = Node(lambda key, attempt: Status.E2BIG if key == b"doc-0003" else Status.SUCCESS)
    counts = _restore(node, _docs(10))
    assert counts.written == 9 and counts.failed == 1 and counts.statuses == {"0x03": 1}


@pytest.mark.parametrize("force,collections", [(False, True), (True, False), (True, True)])
def test_the_batch_encoder_is_the_per_document_one(force, collections):
    docs = [(W.Doc(key=b"k%d" % i, collection_id=(i % 3) * 0x88, rev_seqno=i, cas=99 + i, flags=i, expiry=2 * i,
                   datatype=i % 2, deleted=i % 4 == 0, value=b"" if i % 4 == 0 else b"v" * i, expired=i % 8 == 0),
             i % 64) for i in range(40)]
    first = 0xFFFFFFF0           # the opaques wrap within 32 bits
    packed = W.write_frames(docs, first, force=force, collections=collections)
    assert packed == b"".join(W.write_frame(d, vbucket=vb, opaque=(first + i) & 0xFFFFFFFF, force=force,
                                            collections=collections) for i, (d, vb) in enumerate(docs))


def _plan_rows(rows):
    """`rows` (the plan's documents and their values as stored) through documents.projection
    in DuckDB, as DuckDB hands them over."""
    import duckdb
    con = duckdb.connect()
    con.execute("CREATE TABLE t (vbucket INT, collection_id UINTEGER, key BLOB, rev_seqno UBIGINT, cas UBIGINT, "
                "item_flags UINTEGER, expiration UINTEGER, state VARCHAR, datatype UTINYINT, value BLOB)")
    con.executemany("INSERT INTO t VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    return con.execute(D.projection("SELECT * FROM t")).fetchall()


def test_the_rows_of_the_plan_become_documents():
    import cramjam
    body = b'{"a":"' + b"z" * 200 + b'"}'
    xattrs = b"\x00\x00\x00\x0e\x00\x00\x00\x0a_sync\x00{}\x00"
    batch = _plan_rows([
        (1, 0, b"a", 3, 10, 7, 0, "live", 3, bytes(cramjam.snappy.compress_raw(body))),
        (2, 8, b"b", 4, 11, 7, 99, "deleted", 1, b"x"),
        (3, None, b"c", 5, 12, 7, 50, "expired", 0, b""),
        (4, 0, b"d", 6, 13, 7, 0, "deleted", 4, xattrs),
        (5, 0, b"e", 7, 14, 9, 77, "live", 1, b"{}")])
    docs = D.docs_of(batch)
    assert [tuple(d) for d in docs] == [
        (b"a", 0, 3, 10, 7, 0, 1, False, body, False),       # Snappy undone
        (b"b", 8, 4, 11, 7, 0, 0, True, b"", False),         # a tombstone keeps nothing but xattrs
        (b"c", 0, 5, 12, 7, 0, 0, True, b"", True),          # an expiration: DEL_WITH_META, IS_EXPIRATION
        (b"d", 0, 6, 13, 7, 0, 4, True, xattrs, False),      # a tombstone's xattrs kept as stored
        (b"e", 0, 7, 14, 9, 77, 1, False, b"{}", False)]     # a live document keeps its expiry
    assert all(isinstance(d, W.Doc) for d in docs) and docs[4].expiry == 77
    assert [d.key for d in D.docs_of(batch, D.key_matcher("[ace]"))] == [b"a", b"c", b"e"]
    missing = _plan_rows([(1, 0, b"k1", 1, 1, 0, 0, "live", 1, None), (2, 0, b"k2", 1, 1, 0, 0, "live", 1, b"{}")])
    with pytest.raises(D.BadFrame, match="'k1'"):
        D.docs_of(missing)
    assert [d.key for d in D.docs_of(missing, D.key_matcher("k2"))] == [b"k2"]   # --keys first


def test_answers_are_split_as_every_frame_is():
    from dcptool.protocol.dcp.wire.frames import split_until_error
    ok = m.encode(m.Response(opcode=Opcode.SET_WITH_META, opaque=7, status=0))
    nmvb = m.encode(m.Response(opcode=Opcode.SET_WITH_META, opaque=8, status=Status.NOT_MY_VBUCKET, value=b'{"rev":9}'))
    flex = m.encode(m.Response(opcode=Opcode.SET_WITH_META, opaque=9, status=Status.ETMPFAIL,
                               frame_infos=((0, b"\x00\x05"),)))
    push = m.encode(m.Request(opcode=Opcode.GET_CLUSTER_CONFIG, opaque=10, magic=0x82, value=b"{}"))
    stream = ok + nmvb + flex + push + ok[:10]
    bounds, consumed, err = W.split_answers(stream)
    assert [(p, n) for p, n, _, _ in bounds] == split_until_error(stream)[0] and consumed == len(stream) - 10
    assert [(o, st) for _, _, o, st in bounds][:3] == [(7, 0), (8, Status.NOT_MY_VBUCKET), (9, Status.ETMPFAIL)]
    assert err is None
    bad = ok + b"\x42" + ok[1:]
    bounds, consumed, err = W.split_answers(bad)
    assert len(bounds) == 1 and consumed == len(ok) and err is not None and "magic" in str(err)
    huge = bytearray(ok)
    huge[8:12] = (1 << 30).to_bytes(4, "big")          # a body past the cap: refused, not waited for
    assert W.split_answers(bytes(huge))[2] is not None
