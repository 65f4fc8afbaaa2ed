"""The sans-IO consumer, driven against the sans-IO producer in memory (no sockets) and
against hand-built frames. Time is an argument everywhere: no sleeps."""

from __future__ import annotations

import dataclasses

import pytest

from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.client.phases import (
    STREAM_MOVES,
    ConnPhase,
    IllegalTransition,
    StreamPhase,
    move,
)
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import SnapshotFlag, Status, StreamEndReason
from dcptool.protocol.errors import AuthRefused, ErrorCode, ProtocolError, RemoteError
from tests.support.dcp_pair import Pair, cfg


def test_all_items_once_in_order():
    srv = P.server_from_options(vbuckets=64, items=3000, seed=3)
    pair = Pair(srv, cfg()).run()
    assert pair.cons.finished and pair.of(dcp_consumer.Finished) == [dcp_consumer.Finished(64, 0)]
    data = pair.data()
    total = 0
    for vb in srv.buckets["default"].vbuckets:
        got = data.get(vb.vbid, [])
        assert [s for s, _ in got] == list(range(1, vb.high_seqno + 1))
        assert [k for _, k in got] == [it.key for it in vb.items()]
        total += len(got)
    assert total == 3000
    assert pair.cons.receiver.data_frames == 3000


def test_handshake_order_and_byte_at_a_time():
    srv = P.server_from_options(vbuckets=4, items=50, seed=1)
    pair = Pair(srv, cfg(vbuckets=[0, 1, 2, 3]), byte_at_a_time=True).run()
    ops = [m.decode_bytes(f).op_code for f in pair.outbound]
    assert ops[:3] == [0x1F, 0x89, 0x50]           # HELLO, SELECT_BUCKET, DCP_OPEN (no user)
    controls = [m.decode_bytes(f) for f in pair.outbound if f[1] == 0x5E]
    assert [(c.key, c.value) for c in controls] == [
        (b"connection_buffer_size", b"65536"), (b"set_noop_interval", b"1"), (b"enable_noop", b"true"),
        (b"send_stream_end_on_client_close_stream", b"true"), (b"enable_expiry_opcode", b"true")]
    assert sum(len(v) for v in pair.data().values()) == 50
    assert pair.cons.finished


def test_sasl_scram_and_wrong_password():
    srv = P.server_from_options(vbuckets=2, items=10, users={"admin": "pw1"})
    pair = Pair(srv, cfg(user="admin", password="pw1")).run()
    mechs = [m.decode_bytes(f) for f in pair.outbound if f[1] == 0x21]
    assert mechs[0].mechanism == b"SCRAM-SHA512"
    assert pair.cons.finished
    with pytest.raises(AuthRefused) as info:
        Pair(srv, cfg(user="admin", password="nope")).run()
    assert info.value.status == Status.AUTH_ERROR
    with pytest.raises(AuthRefused) as info:   # no credentials: the bucket is refused
        Pair(srv, cfg()).run()
    assert info.value.status == Status.EACCESS


def test_plain_only_when_allowed():
    srv = P.server_from_options(vbuckets=1, items=1, users={"u": "p"})
    srv_plain_only = srv
    pair = Pair(srv_plain_only, cfg(user="u", password="p", allow_plain=True))
    # the server offers SCRAM too: SCRAM is still preferred
    pair.run()
    assert [m.decode_bytes(f).mechanism for f in pair.outbound if f[1] == 0x21] == [b"SCRAM-SHA512"]


def test_unknown_bucket_status():
    srv = P.server_from_options(vbuckets=1, items=1)
    with pytest.raises(RemoteError) as info:
        Pair(srv, cfg(bucket="nope")).run()
    assert info.value.status == Status.KEY_ENOENT and info.value.code == ErrorCode.STATUS


def test_control_refusal_reported_not_fatal():
    sc = P.Scenarios(refuse_controls=("enable_expiry_opcode", "connection_buffer_size"))
    srv = P.server_from_options(vbuckets=2, items=20, scenarios=sc)
    pair = Pair(srv, cfg()).run()
    refused = {e.key: e.status for e in pair.of(dcp_consumer.ControlRefused)}
    assert refused == {"enable_expiry_opcode": Status.NOT_SUPPORTED, "connection_buffer_size": Status.NOT_SUPPORTED}
    assert pair.cons.finished and not pair.cons.handshake.buffer_active
    assert not any(f[1] == 0x5D for f in pair.outbound)   # no acks without flow control


def test_required_noop_refusal_is_fatal_with_collections():
    sc = P.Scenarios(refuse_controls=("enable_noop",))
    srv = P.server_from_options(vbuckets=1, items=1, scenarios=sc)
    with pytest.raises(RemoteError) as info:
        Pair(srv, cfg(collections=True)).run()
    assert info.value.code == ErrorCode.UNSUPPORTED


def test_rollback_loop_after_failover():
    srv = P.server_from_options(vbuckets=4, items=400, seed=5)
    bucket = srv.buckets["default"]
    first = Pair(srv, cfg(to="now")).run()
    state = first.cons.streams.resume_state()
    assert all(s.last_seqno == bucket.vbuckets[vb].high_seqno for vb, s in state.items())
    assert all(s.ended_reason == StreamEndReason.OK for s in state.values())
    state = {vb: dataclasses.replace(s, ended_reason=None) for vb, s in state.items()}  # a later run
    # two failovers in a row: the consumer's uuid is two branches back
    r1 = bucket.fail_over_all(loss=30)
    r2 = bucket.fail_over_all(loss=10)
    second = Pair(srv, cfg(to="now"), resume=state).run()
    rollbacks = second.of(dcp_consumer.Rollback)
    assert {e.vbucket: e.seqno for e in rollbacks} == {vb: r1[vb] for vb in range(4)}
    reqs = [m.decode_bytes(f) for f in second.outbound if f[1] == 0x53]
    for vb in range(4):
        again = [r for r in reqs if r.vbucket == vb]
        assert again[0].start_seqno == state[vb].last_seqno
        assert again[1].start_seqno == r1[vb] and again[1].snap_start == again[1].snap_end == r1[vb]
        assert again[1].vbucket_uuid == state[vb].failover_log[0][0]
    assert second.cons.finished
    data = second.data()
    for vb in bucket.vbuckets:   # after the rollback: exactly the new branch above r1
        assert [s for s, _ in data[vb.vbid]] == list(range(r1[vb.vbid] + 1, vb.high_seqno + 1))
        assert second.cons.streams.resume_state()[vb.vbid].failover_log == vb.failover_log
    assert r2 == {vb: bucket.vbuckets[vb].failover_log[0][1] for vb in range(4)}


def test_resume_mid_snapshot_has_no_gap_or_duplicate():
    srv = P.server_from_options(vbuckets=8, items=2000, seed=9,
                                scenarios=P.Scenarios(disconnect_after=700))
    first = Pair(srv, cfg()).run()
    assert first.prod.closed and not first.cons.finished
    state = first.cons.streams.resume_state()
    incomplete = [vb for vb, s in state.items() if not s.snapshot_complete]
    assert incomplete   # some vbucket was cut inside its disk snapshot
    second = Pair(srv, cfg(), resume=state).run()
    assert second.cons.finished and not second.of(dcp_consumer.Rollback)
    a, b = first.data(), second.data()
    for vb in srv.buckets["default"].vbuckets:
        seqs = [s for s, _ in a.get(vb.vbid, [])] + [s for s, _ in b.get(vb.vbid, [])]
        assert seqs == list(range(1, vb.high_seqno + 1))


def test_stream_end_reasons_decoded_and_reopened():
    reasons = tuple(range(9))
    srv = P.server_from_options(vbuckets=9, items=900, seed=2, scenarios=P.Scenarios(end_reasons=reasons))
    pair = Pair(srv, cfg(collections=True)).run()
    ends = {e.vbucket: e for e in pair.of(dcp_consumer.StreamEnded) if e.reason != 0 or e.vbucket == 0}
    got = {}
    for raw in pair.inbound:
        msg = m.decode_bytes(raw, True)
        if isinstance(msg, m.StreamEnd):
            got.setdefault(msg.vbucket, []).append(msg.reason)
    for vb in range(9):
        assert got[vb][0] == vb                       # every reason arrives and decodes
        assert ends[vb].final == (vb not in dcp_consumer.DEFAULT_REOPEN)
    assert pair.cons.finished


def test_stream_end_7_8_become_ok_without_collections():
    srv = P.server_from_options(vbuckets=9, items=90, scenarios=P.Scenarios(end_reasons=tuple(range(9))))
    pair = Pair(srv, cfg()).run()
    firsts = {}
    for raw in pair.inbound:
        msg = m.decode_bytes(raw)
        if isinstance(msg, m.StreamEnd):
            firsts.setdefault(msg.vbucket, msg.reason)
    assert firsts[7] == firsts[8] == StreamEndReason.OK


def test_noop_answered_and_dead_connection_check():
    srv = P.server_from_options(vbuckets=1, items=5)
    pair = Pair(srv, cfg(to="forever", noop_interval=2.0))
    pair.run(max_steps=50)
    assert not pair.cons.finished
    for _ in range(3):
        pair.now += 2.0
        pair.step()
        pair.step()
    assert pair.prod.stats["noops_sent"] == 3 and pair.prod.stats["noops_answered"] == 3
    noop_rsps = [f for f in pair.outbound if f[0] == 0x81 and f[1] == 0x5C]
    assert len(noop_rsps) == 3
    pair.cons.check(pair.now + 3.9)   # silent for less than 2x the interval: alive
    with pytest.raises(RemoteError) as info:
        pair.cons.check(pair.now + 4.1)
    assert info.value.code == ErrorCode.DEAD_CONNECTION


def test_buffer_ack_at_half_and_pause():
    srv = P.server_from_options(vbuckets=4, items=4000, seed=1)
    paused = {"on": True}
    c = cfg(buffer_size=32 * 1024)
    pair = Pair(srv, c)
    pair.cons.should_pause = lambda: paused["on"]
    pair.run(max_steps=200)
    # paused: the producer stops at the window, nothing acked
    assert pair.prod.outstanding >= 32 * 1024 and pair.cons.receiver.acked_total == 0
    assert pair.prod.stats["max_outstanding"] < 32 * 1024 + 200
    paused["on"] = False
    pair.cons.flush_acks()
    pair.run()
    acks = [m.decode_bytes(f).bytes_acked for f in pair.outbound if f[1] == 0x5D]
    assert acks and all(a >= 16 * 1024 for a in acks)
    assert pair.cons.finished
    assert pair.prod.stats["max_outstanding"] < 32 * 1024 + 200


def test_to_seqno_and_from_seqno():
    srv = P.server_from_options(vbuckets=2, items=200, seed=4)
    pair = Pair(srv, cfg(start="10", to="20")).run()
    data = pair.data()
    assert {vb: [s for s, _ in v] for vb, v in data.items()} == {0: list(range(11, 21)), 1: list(range(11, 21))}
    flog_reqs = [f for f in pair.outbound if f[1] == 0x54]
    assert len(flog_reqs) == 2 and not pair.of(dcp_consumer.Rollback)


def test_from_now_forever_gets_only_new_items():
    srv = P.server_from_options(vbuckets=4, items=100, seed=4)
    pair = Pair(srv, cfg(start="now", to="forever")).run(max_steps=100)
    assert pair.data() == {}
    srv.buckets["default"].mutate_random(50)
    pair.run(max_steps=100)
    got = pair.data()
    assert sum(len(v) for v in got.values()) > 0
    for vb, items in got.items():
        high0 = srv.buckets["default"].vbuckets[vb].disk_high
        assert all(s > high0 for s, _ in items)


def test_close_streams():
    srv = P.server_from_options(vbuckets=2, items=10)
    pair = Pair(srv, cfg(to="forever")).run(max_steps=100)
    pair.cons.close_streams()
    pair.run(max_steps=100)
    assert [e.reason for e in pair.of(dcp_consumer.StreamEnded)] == [StreamEndReason.CLOSED] * 2
    assert pair.cons.finished


def test_vbstate_request_seqnos():
    s = dcp_consumer.VbState(failover_log=[(7, 0)], last_seqno=5, snap_start=0, snap_end=10, snapshot_complete=False)
    assert s.request_seqnos() == (5, 7, 0, 10)
    s = dataclasses.replace(s, snapshot_complete=True)
    assert s.request_seqnos() == (5, 7, 5, 5)


def test_stream_requests_in_flight_are_bounded():
    srv = P.server_from_options(vbuckets=16, items=160, seed=1)
    pair = Pair(srv, cfg(max_in_flight=4))
    in_flight_max = 0
    for _ in range(1000):
        out = pair.cons.outgoing()
        reqs = sum(1 for f in out if f[1] == 0x53)
        in_flight_max = max(in_flight_max, reqs)
        for f in out:
            pair.outbound.append(f)
            pair.prod.receive(f, pair.now)
        data = b"".join(bytes(x) for x in pair.prod.pull(pair.now))
        if data:
            pair.events += pair.cons.feed(data, pair.now)
        if pair.cons.finished:
            break
    assert pair.cons.finished and in_flight_max == 4
    assert sum(1 for f in pair.outbound if f[1] == 0x53) == 16


def test_snapshot_ack_and_set_vbucket_state_are_answered():
    srv = P.server_from_options(vbuckets=1, items=3)
    pair = Pair(srv, cfg(to="forever")).run(max_steps=50)
    opaque = pair.cons.streams.opaque_of(0)
    assert opaque > 0
    marker = m.encode(m.SnapshotMarker(vbucket=0, opaque=opaque, snap_start=4, snap_end=4,
                                       snap_flags=SnapshotFlag.MEMORY | SnapshotFlag.ACK))
    state = m.encode(m.SetVbucketState(vbucket=0, opaque=opaque, state=1))
    pair.cons.feed(marker + state, pair.now)
    out = [m.decode_bytes(f) for f in pair.cons.outgoing()]
    assert [(r.op_code, r.opaque, r.status) for r in out] == [(0x56, opaque, 0), (0x5B, opaque, 0)]
    assert all(r.IS_RESPONSE for r in out)


def test_seqno_regression_is_a_remote_error():
    srv = P.server_from_options(vbuckets=1, items=5)
    pair = Pair(srv, cfg(to="forever")).run(max_steps=50)
    opaque = pair.cons.streams.opaque_of(0)
    bad = m.encode(m.Mutation(vbucket=0, opaque=opaque, key=b"k", by_seqno=2, rev_seqno=1))
    with pytest.raises(RemoteError) as info:
        pair.cons.feed(bad, pair.now)
    assert info.value.code == ErrorCode.UNEXPECTED_MESSAGE


def _run_columnar(pair: Pair) -> Pair:
    """Drive pair the way the transport does: every pull scanned into numpy offsets, so long
    receives take the consumer's vectorised path."""
    from dcptool.protocol.dcp.wire import columnar
    for _ in range(10_000):
        if pair.cons.finished or pair.prod.closed:
            break
        for fr in pair.cons.outgoing():
            pair.prod.receive(fr, pair.now)
        pair.prod.tick(pair.now)
        data = b"".join(bytes(x) for x in pair.prod.pull(pair.now))
        if not data:
            break
        offsets, lengths, consumed, err = columnar.scan(data)
        assert consumed == len(data) and err is None
        pair.events += pair.cons.receive(data, offsets, lengths, pair.now)
    return pair


def test_vectorised_receive_takes_consecutive_per_frame_frames_in_one_call(monkeypatch):
    """Issue 26: the data frames that arrive in the same receive as their stream's answer
    cannot be checked column-wise (the stream is not open when the columns are built); they
    go through the per-frame loop together, one call per run of them, with the same result
    as frame-by-frame delivery."""
    srv = P.server_from_options(vbuckets=8, items=4000, seed=5)
    ref = Pair(srv, cfg(buffer_size=4 << 20)).run()
    calls = []
    from dcptool.protocol.dcp.client import consumer_receive
    receiver = next(c for c in vars(consumer_receive).values()
                    if isinstance(c, type) and hasattr(c, "_receive_vectorised"))
    original = receiver._receive_frames

    def counting(self, buf, offsets, lengths, now):
        calls.append(len(offsets))
        return original(self, buf, offsets, lengths, now)

    monkeypatch.setattr(receiver, "_receive_frames", counting)
    srv2 = P.server_from_options(vbuckets=8, items=4000, seed=5)
    got = _run_columnar(Pair(srv2, cfg(buffer_size=4 << 20)))
    assert got.cons.finished and got.cons.receiver.data_frames == ref.cons.receiver.data_frames == 4000
    assert {vb: s.last_seqno for vb, s in got.cons.streams.vb_states().items()} == \
        {vb: s.last_seqno for vb, s in ref.cons.streams.vb_states().items()}
    assert got.of(dcp_consumer.Finished) == ref.of(dcp_consumer.Finished)
    # some call took many frames at once (before: one call per such frame)
    assert max(calls) >= 100 and len(calls) < sum(calls) / 10


def test_phases_move_only_as_their_tables_allow():
    """Issue 35: the connection's and each stream's phases are enums moved through one table
    each; a run visits them in order, and a move the table lacks is a typed protocol error."""
    srv = P.server_from_options(vbuckets=4, items=40, seed=3)
    pair = Pair(srv, cfg(vbuckets=[0, 1, 2, 3]))
    assert pair.cons.handshake.phase is ConnPhase.HELLO and not pair.cons.handshake.streaming
    pair.run()
    assert pair.cons.handshake.phase is ConnPhase.STREAMING and pair.cons.finished
    assert set(pair.cons.streams.phase.values()) == {StreamPhase.DONE}
    # routing a connection that was never asked for its map: HELLO cannot move to OPEN
    c = dcp_consumer.Consumer(cfg(vbuckets=[0]), now=0.0)
    c.start(0.0)
    with pytest.raises(IllegalTransition, match="no move from phase 'hello' to 'open'") as exc:
        c.route([0])
    assert isinstance(exc.value, ProtocolError) and exc.value.code == ErrorCode.UNEXPECTED_MESSAGE
    with pytest.raises(IllegalTransition, match="vbucket 3: no move from phase 'done' to 'open'"):
        move(STREAM_MOVES, StreamPhase.DONE, StreamPhase.OPEN, "vbucket 3")
