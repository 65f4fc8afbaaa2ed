"""The lag poll of the sans-IO consumer (Consumer.polls, lag_polls.py, used by capture/lag.py),
against the sans-IO producer in memory: a poll asked mid-stream is answered with the active
vbuckets' high seqnos; a poll asked as the last stream ends keeps the connection unfinished
until its answer is in (so a `--to now` run ends with a recorded lag of 0)."""

from __future__ import annotations

from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.wire import messages as m
from tests.support.dcp_pair import Pair, cfg


def _streaming_pair():
    srv = P.server_from_options(vbuckets=4, items=200, seed=4)
    pair = Pair(srv, cfg())
    while not pair.cons.handshake.streaming:
        assert pair.step()
    return srv, pair


def test_poll_mid_stream_is_answered_with_high_seqnos():
    srv, pair = _streaming_pair()
    pair.cons.polls.request()
    pair.run()
    polls = pair.of(dcp_consumer.VbSeqnos)
    highs = {vb.vbid: vb.high_seqno for vb in srv.buckets["default"].vbuckets}
    assert [(p.seqnos, p.status) for p in polls] == [(tuple(sorted(highs.items())), 0)]
    sent = [m.decode_bytes(f) for f in pair.outbound]
    asked = [x for x in sent if type(x) is m.GetAllVbSeqnos and x.extras]
    assert [x.extras for x in asked] == [b"\0\0\0\1"]       # state: active only


def test_a_poll_pending_at_the_end_keeps_the_connection_open_until_answered():
    _, pair = _streaming_pair()
    while not pair.cons.streams.finished:
        assert pair.step()
    assert pair.cons.finished
    pair.cons.polls.request()          # what capture/lag.py does as the last stream ends
    assert not pair.cons.finished and pair.cons.polls.pending == 1
    pair.run()
    assert pair.cons.finished and pair.cons.polls.pending == 0
    assert len(pair.of(dcp_consumer.VbSeqnos)) == 1


def test_an_unanswered_last_poll_is_given_up_after_the_timeout():
    _, pair = _streaming_pair()
    while not pair.cons.streams.finished:
        assert pair.step()
    pair.cons.polls.request()
    pair.cons.outgoing()                # never reaches the server: no answer will come
    timeout = pair.cons.link.cfg.timeout
    pair.cons.check(pair.now + timeout / 2)
    assert not pair.cons.finished
    pair.cons.check(pair.now + timeout + 1)   # no TIMEOUT error: the run is over, not the connection dead
    assert pair.cons.finished and pair.cons.polls.pending == 0


def test_an_answer_carries_where_each_stream_stood_in_wire_order():
    """The poll's positions are the seqnos received before its answer, frame by frame (the
    `lag` table's definition), not the snapshot boundaries: asked mid-backfill, answered
    between two mutations of a disk snapshot (a fresh stream stands at 0 before its first)."""
    srv = P.server_from_options(vbuckets=4, items=4000, seed=4)
    pair = Pair(srv, cfg(buffer_size=8192))      # flow control: the backfill comes in steps
    while not pair.data():           # the backfill has begun
        assert pair.step()
    pair.cons.polls.request()
    pair.run()
    (poll,) = pair.of(dcp_consumer.VbSeqnos)
    want, asked = {}, set()
    for raw in pair.inbound:
        msg = m.decode_bytes(raw)
        if type(msg) is m.GetAllVbSeqnosResponse and msg.seqnos and msg.opaque not in asked:
            if len(asked) == 1:      # the handshake's answer came first
                break
            asked.add(msg.opaque)
        elif isinstance(msg, (m.Mutation, m.Deletion, m.Expiration)):
            want[msg.vbucket] = msg.by_seqno
    got = dict(poll.positions)
    assert got == {vb: want.get(vb, 0) for vb in got} and sorted(got) == [0, 1, 2, 3]
    highs = dict(poll.seqnos)
    assert any(0 < got[vb] < highs[vb] for vb in got), "answered mid-backfill"
    assert poll.lags() == [(vb, highs[vb], got[vb], highs[vb] - got[vb]) for vb in sorted(got)]
