"""The producer's answer to a STREAM_REQ, sans-IO, for both servers of `serve dcp`: the
generated producer (producer.py) and the playback of a capture (recorded_producer.py). One decision
(DCP_DIGEST §6.2): FROM_LATEST, the requested range, the rollback decision of
bucket.rollback_seqno, TO_LATEST, then the range rule, which is the one thing the two
servers differ in (a parameter: LIVE_RANGE or RECORDED_RANGE, docs/CLUSTER.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, NamedTuple

from dcptool.protocol.dcp.server.bucket import rollback_seqno
from dcptool.protocol.dcp.wire.constants import (
    SEQNO_INFINITY,
    Status,
    StreamRequestFlag,
)
from dcptool.protocol.dcp.wire.message_types import StreamRequest


class Requested(NamedTuple):
    """A stream request's range, FROM_LATEST applied."""
    start: int
    end: int
    uuid: int
    snap_start: int
    snap_end: int


class Decision(NamedTuple):
    status: int                  # SUCCESS, ROLLBACK or ERANGE
    end: int = 0                 # the stream's end seqno (TO_LATEST applied) when SUCCESS
    rollback_seqno: int = 0      # when ROLLBACK


def live_range(start: int, end: int, high: int) -> bool:
    """Couchbase's rule (kv_engine): the stream starts at or below the high seqno."""
    return not (start > end or start > high)


def recorded_range(start: int, end: int, high: int) -> bool:
    """Playback's rule: a start past the recording's high seqno is served (an open stream that
    sends nothing more) when the stream has no end; with an end it is ERANGE as in Couchbase."""
    return not (start > high and end != SEQNO_INFINITY)


LIVE_RANGE: Callable[[int, int, int], bool] = live_range
RECORDED_RANGE: Callable[[int, int, int], bool] = recorded_range


def requested(req: StreamRequest, high: int, latest_uuid: int) -> Requested | None:
    """The range a request asks for (FROM_LATEST: from the high seqno, on the latest branch
    when the request names none); None when it is no range (start past end, or outside its
    snapshot): ERANGE."""
    start, end, uuid = req.start_seqno, req.end_seqno, req.vbucket_uuid
    snap_start, snap_end = req.snap_start, req.snap_end
    if req.flags & StreamRequestFlag.FROM_LATEST:
        start = snap_start = snap_end = high
        uuid = uuid or latest_uuid
    if start > end or not snap_start <= start <= snap_end:
        return None
    return Requested(start, end, uuid, snap_start, snap_end)


def decide(req: StreamRequest, r: Requested, *, failover_log: Sequence[tuple[int, int]], high: int, in_range: Callable[[int, int, int], bool],
           purge_seqno: int = 0) -> Decision:
    """ROLLBACK (to the seqno of rollback_seqno), ERANGE (the range rule `in_range` refuses
    it), or SUCCESS with the stream's end."""
    rb = rollback_seqno(start=r.start, vb_uuid=r.uuid, snap_start=r.snap_start, snap_end=r.snap_end,
                        failover_log=failover_log, high_seqno=high, purge_seqno=purge_seqno,
                        strict=bool(req.flags & StreamRequestFlag.STRICT_VB_UUID))
    if rb is not None:
        return Decision(Status.ROLLBACK, rollback_seqno=rb)
    end = high if req.flags & StreamRequestFlag.TO_LATEST else r.end
    if not in_range(r.start, end, high):
        return Decision(Status.ERANGE)
    return Decision(Status.SUCCESS, end=end)
