"""The in-memory DCP pair: the sans-IO consumer wired to a connection of the sans-IO producer,
no sockets, time an argument (the model is h11's tests/helpers.py ConnectionPair). `Pair` records
every frame both ways and the consumer's events; `cfg` is a ConsumerConfig with test defaults."""

from __future__ import annotations

from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.frames import split


class Pair:
    """A consumer wired to a producer connection; records every frame both ways."""

    def __init__(self, server, cfg, resume=None, now=0.0, byte_at_a_time=False):
        self.server = server
        self.prod = server.connect(now)
        self.cons = dcp_consumer.Consumer(cfg, resume, now)
        self.now = now
        self.inbound: list[bytes] = []
        self.outbound: list[bytes] = []
        self.events: list = []
        self.byte_at_a_time = byte_at_a_time
        self.cons.start(now)

    def step(self) -> bool:
        moved = False
        for fr in self.cons.outgoing():
            self.outbound.append(fr)
            self.prod.receive(fr, self.now)
            moved = True
        self.prod.tick(self.now)
        data = b"".join(bytes(x) for x in self.prod.pull(self.now))
        if data:
            moved = True
            bounds, used = split(data)
            assert used == len(data)
            self.inbound.extend(data[o:o + n] for o, n in bounds)
            if self.byte_at_a_time:
                for i in range(len(data)):
                    self.events += self.cons.feed(data[i:i + 1], self.now)
            else:
                self.events += self.cons.feed(data, self.now)
        return moved

    def run(self, max_steps=100_000, advance=0.0):
        for _ in range(max_steps):
            if self.cons.finished or self.prod.closed:
                break
            if not self.step():
                if not advance:
                    break
                self.now += advance
        # deliver what is left
        self.step()
        return self

    def data(self, collections=False):
        """{vb: [(seqno, key)]} of the item frames received, in order."""
        out = {}
        for raw in self.inbound:
            msg = m.decode_bytes(raw, collections)
            if isinstance(msg, (m.Mutation, m.Deletion, m.Expiration)):
                out.setdefault(msg.vbucket, []).append((msg.by_seqno, msg.key))
        return out

    def of(self, cls):
        return [e for e in self.events if isinstance(e, cls)]


def cfg(**kw):
    base = dict(bucket="default", name="test", buffer_size=64 * 1024, noop_interval=1.0)
    base.update(kw)
    return dcp_consumer.ConsumerConfig(**base)
