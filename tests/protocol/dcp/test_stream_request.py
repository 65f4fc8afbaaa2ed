"""The one stream-request decision of both servers (protocol/dcp/server/stream_request.py)
and the one stream key (constants.stream_key)."""

from __future__ import annotations

import numpy as np
import pytest

from dcptool.protocol.dcp.server.stream_request import (
    LIVE_RANGE,
    RECORDED_RANGE,
    decide,
    requested,
)
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import (
    NUM_VB_SLOTS,
    SEQNO_INFINITY,
    Status,
    StreamRequestFlag,
    key_sid,
    key_vb,
    stream_key,
)

LOG = [(0xBB, 50), (0xAA, 0)]      # newest first
HIGH = 100


def _req(start, end=SEQNO_INFINITY, uuid=0xBB, flags=0, snap=None):
    ss, se = snap if snap is not None else (start, start)
    return m.StreamRequest(vbucket=3, flags=int(flags), start_seqno=start, end_seqno=end, vbucket_uuid=uuid,
                           snap_start=ss, snap_end=se)


def _decide(req, rule, log=LOG):
    r = requested(req, HIGH, log[0][0])
    return None if r is None else decide(req, r, failover_log=log, high=HIGH, in_range=rule)


@pytest.mark.parametrize("rule", [LIVE_RANGE, RECORDED_RANGE])
def test_both_rules_agree_inside_the_history(rule):
    assert _decide(_req(10), rule) == (Status.SUCCESS, SEQNO_INFINITY, 0)
    assert _decide(_req(10, end=40), rule) == (Status.SUCCESS, 40, 0)
    assert _decide(_req(10, end=5), rule) is None                       # start past end: ERANGE
    assert _decide(_req(10, snap=(11, 20)), rule) is None               # start outside its snapshot
    assert _decide(_req(60, uuid=0xAA), rule) == (Status.ROLLBACK, 0, 50)   # ahead on an old branch
    assert _decide(_req(0, flags=StreamRequestFlag.TO_LATEST), rule) == (Status.SUCCESS, HIGH, 0)


def test_from_latest_starts_at_the_high_seqno_on_the_latest_branch():
    r = requested(_req(0, uuid=0, flags=StreamRequestFlag.FROM_LATEST), HIGH, 0xBB)
    assert r == (HIGH, SEQNO_INFINITY, 0xBB, HIGH, HIGH)


def test_playback_serves_an_open_ended_start_past_the_recording_couchbase_does_not():
    # the recorded failover log names a branch from 120 while the recorded history ends at
    # HIGH = 100: a request on the branch before it, from 110, needs no rollback
    log = [(0xCC, 120), *LOG]
    past = _req(110, uuid=0xBB)
    assert _decide(past, LIVE_RANGE, log) == (Status.ERANGE, 0, 0)
    assert _decide(past, RECORDED_RANGE, log) == (Status.SUCCESS, SEQNO_INFINITY, 0)
    bounded = _req(110, end=115, uuid=0xBB)
    assert _decide(bounded, LIVE_RANGE, log).status == _decide(bounded, RECORDED_RANGE, log).status == Status.ERANGE
    # past the newest branch's high seqno it is a rollback for both
    assert _decide(_req(150), LIVE_RANGE) == _decide(_req(150), RECORDED_RANGE) == (Status.ROLLBACK, 0, HIGH)


def test_the_stream_key_is_dense_and_undone_by_key_vb_and_key_sid():
    keys = {stream_key(vb, sid) for vb in range(NUM_VB_SLOTS) for sid in range(4)}
    assert keys == set(range(4 * NUM_VB_SLOTS))                        # one slot per (vb, sid), no gaps
    assert stream_key(7, 0) == 7                                       # without stream ids: the vbucket
    assert [(key_vb(k), key_sid(k)) for k in (stream_key(1023, 2), stream_key(0, 1))] == [(1023, 2), (0, 1)]
    vb, sid = np.array([5, 1023, 0]), np.array([0, 3, 1])
    assert stream_key(vb, sid).tolist() == [stream_key(5, 0), stream_key(1023, 3), stream_key(0, 1)]
