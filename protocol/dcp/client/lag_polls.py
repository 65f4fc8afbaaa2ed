"""The consumer's lag polls, sans-IO: GET_ALL_VB_SEQNOS of the active vbuckets, asked by the
caller (capture/lag.py, a cluster session), answered as a VbSeqnos event that also carries
where each streamed vbucket stood when the answer was read (Streams.positions), so the lag is
the `lag` table's (replay/rules/lag.py) to the item. A part of
consumer.Consumer: the connection waits for the polls in flight before it counts as finished
(a poll asked as the last stream ends is still answered), and once every stream has ended a
poll unanswered for the timeout is given up (the run is over, not the connection dead)."""

from __future__ import annotations

from typing import Any, Callable

from dcptool.protocol.dcp.client.consumer_api import VbSeqnos
from dcptool.protocol.dcp.client.link import Link
from dcptool.protocol.dcp.wire import messages as m

ACTIVE_STATE = (1).to_bytes(4, "big")    # GET_ALL_VB_SEQNOS extras: the active vbuckets only


class LagPolls:
    def __init__(self, link: Link, positions: Callable[[], dict[int, int]]) -> None:
        self.link = link
        self.positions = positions       # Streams.positions: where each requested vbucket stands now
        self._asked: set[int] = set()    # the opaques of the polls not answered yet

    @property
    def pending(self) -> int:
        """Polls not answered yet: the connection is not finished."""
        return len(self._asked)

    def request(self) -> None:
        """Ask the high seqnos of the active vbuckets; the answer comes as VbSeqnos."""
        self._asked.add(self.link.request(m.GetAllVbSeqnos(extras=ACTIVE_STATE), self._on_seqnos))

    def _on_seqnos(self, rsp: Any) -> None:
        self._asked.discard(rsp.opaque)
        status = getattr(rsp, "status", 0)
        seqnos = tuple(getattr(rsp, "seqnos", ()) or ()) if status == 0 else ()
        now = self.positions() if seqnos else {}
        self.link.emit(VbSeqnos(seqnos, status, tuple((vb, now[vb]) for vb, _ in seqnos if vb in now)))

    def give_up(self, now: float, timeout: float) -> None:
        """Every stream ended: a poll unanswered for `timeout` seconds is dropped."""
        for opaque in list(self._asked):
            sent = self.link.sent_time(opaque)
            if sent is not None and now - sent > timeout:
                self.link.forget(opaque)
                self._asked.discard(opaque)
