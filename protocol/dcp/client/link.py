"""What the phases of the DCP consumer share, sans-IO: the configuration, the frames to
send, the events to emit, the requests waiting for their answer (by opaque, each with the
handler of its answer and when it left) and the clock of the last call.

The consumer is composed of parts that each own their state (handshake.py, streams.py,
consumer_receive.py, lag_polls.py) and talk through this object and each other's public
methods: a part changes its own fields only (tests/test_architecture.py checks it), so the
configuration changes here, through `reconfigure`, and a request is given up through `forget`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from dcptool.protocol.dcp.client.consumer_api import ConsumerConfig
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import Opcode, op_name

Handler = Callable[[Any], None]     # what runs with the answer to a request


def sids_of(cfg: ConsumerConfig) -> tuple[int, ...]:
    """The stream ids of a configuration: one per group (sid 1..n), or (0,) = none."""
    groups = len(cfg.stream_filters if cfg.stream_filters is not None else cfg.stream_groups)
    return tuple(range(1, max(1, groups) + 1)) if cfg.stream_ids else (0,)


class Link:
    def __init__(self, config: ConsumerConfig, now: float) -> None:
        self.cfg = config
        self.sids: tuple[int, ...] = sids_of(config)     # stream ids (1..n), or (0,) = none
        self.now = now
        self.out: list[bytes] = []
        self.events: list[Any] = []
        self.pending: dict[int, Handler] = {}
        self.sent_at: dict[int, tuple[float, str]] = {}   # opaque -> (when, what) of a pending request
        self.unstamped: list[int] = []     # requests queued since the last stamp_sent()
        self.vb_opaque: dict[int, int] = {}       # request opaque -> vbucket (for rows)
        self.opaque = 0

    def at(self, now: float) -> None:
        """The clock of the current call (what a request queued now is stamped with)."""
        self.now = now

    def reconfigure(self, **changes: Any) -> None:
        """The configuration with these fields changed (the vbuckets found or routed, handoff)."""
        self.cfg = dataclasses.replace(self.cfg, **changes)

    def request(self, msg: Any, handler: Handler) -> int:
        """Queue a request with the next opaque; `handler(answer)` runs when it is answered."""
        self.opaque += 1
        opaque = self.opaque
        msg = dataclasses.replace(msg, opaque=opaque)
        self.pending[opaque] = handler
        try:
            what = Opcode(msg.op_code).name
        except ValueError:
            what = op_name(msg.op_code)
        if type(msg) is m.StreamRequest or type(msg) is m.GetFailoverLog:
            what += f" (vbucket {msg.vbucket})"
        elif type(msg) is m.Control:
            what += f" {msg.key.decode()}"
        self.sent_at[opaque] = (self.now, what)
        self.unstamped.append(opaque)
        if hasattr(msg, "vbucket"):
            self.vb_opaque[opaque] = msg.vbucket
        self.out.append(m.encode(msg))
        return opaque

    def send(self, msg: Any) -> None:
        """Queue a message that expects no answer (a response, a buffer ack)."""
        self.out.append(m.encode(msg))

    def emit(self, event: Any) -> None:
        self.events.append(event)

    def answered(self, rsp: Any) -> None:
        """A response arrived: its request is no longer pending; its handler runs."""
        handler = self.pending.pop(rsp.opaque, None)
        self.sent_at.pop(rsp.opaque, None)
        if handler is not None:
            handler(rsp)

    def sent_time(self, opaque: int) -> float | None:
        """When the pending request of `opaque` left, None when it is not pending."""
        sent = self.sent_at.get(opaque)
        return None if sent is None else sent[0]

    def forget(self, opaque: int) -> None:
        """Give up waiting for the answer of `opaque` (an answer that comes later is ignored)."""
        self.pending.pop(opaque, None)
        self.sent_at.pop(opaque, None)

    def take_out(self) -> list[bytes]:
        out, self.out = self.out, []
        return out

    def take_events(self) -> list[Any]:
        ev, self.events = self.events, []
        return ev

    def oldest_pending(self) -> tuple[float, str] | None:
        """(when, what) of the request that has waited longest, or None."""
        if not self.sent_at:
            return None
        return min(self.sent_at.values(), key=lambda v: v[0])

    def stamp_sent(self, now: float) -> None:
        if self.unstamped:
            sent = self.sent_at
            for opaque in self.unstamped:
                if opaque in sent:
                    sent[opaque] = (now, sent[opaque][1])
            self.unstamped.clear()

    def restart_clocks(self, now: float) -> None:
        """Every pending request waits from now on (we held reads back)."""
        self.now = now
        for opaque, (sent, what) in self.sent_at.items():
            if sent < now:
                self.sent_at[opaque] = (now, what)
