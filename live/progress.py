"""The numbers of a capture's live progress, without the CLI: totals the network loop sets
(update) or increments (add) as often as it likes, the recent rates (rates) and the stream
positions as one line (positions_text). cli/view/progress.py draws them with rich."""

from __future__ import annotations

import collections
import time
from typing import Callable, Mapping

MAX_POSITIONS = 8   # positions shown; the rest counted


class ProgressCounters:
    """update() sets totals (any subset): frames, wire_bytes, streams_open, streams_ended,
    positions (a mapping vbucket -> last seqno, or "stream/instance" -> token; the live
    dict may be passed once and mutated afterwards), bytes_written, backlog_bytes, note.
    add(frames, wire_bytes) increments the two counters instead."""

    def __init__(self, protocol: str, *, clock: Callable[[], float] = time.monotonic):
        self.protocol = protocol
        self.clock = clock
        self.frames = 0
        self.wire_bytes = 0
        self.streams_open = 0
        self.streams_ended = 0
        self.positions: Mapping = {}
        self.bytes_written = 0
        self.backlog_bytes = 0
        self.note = ""
        self.t0 = clock()
        self._samples: collections.deque = collections.deque(maxlen=64)

    def update(self, *, frames=None, wire_bytes=None, streams_open=None, streams_ended=None,
               positions=None, bytes_written=None, backlog_bytes=None, note=None) -> None:
        if frames is not None:
            self.frames = frames
        if wire_bytes is not None:
            self.wire_bytes = wire_bytes
        if streams_open is not None:
            self.streams_open = streams_open
        if streams_ended is not None:
            self.streams_ended = streams_ended
        if positions is not None:
            self.positions = positions
        if bytes_written is not None:
            self.bytes_written = bytes_written
        if backlog_bytes is not None:
            self.backlog_bytes = backlog_bytes
        if note is not None:
            self.note = note

    def add(self, frames: int = 0, wire_bytes: int = 0) -> None:
        self.frames += frames
        self.wire_bytes += wire_bytes

    def rates(self) -> tuple[float, float]:
        """(frames/s, bytes/s) over the last few seconds."""
        now = self.clock()
        self._samples.append((now, self.frames, self.wire_bytes))
        while len(self._samples) > 2 and now - self._samples[0][0] > 3.0:
            self._samples.popleft()
        t0, f0, b0 = self._samples[0]
        if now - t0 <= 0:
            return 0.0, 0.0
        return (self.frames - f0) / (now - t0), (self.wire_bytes - b0) / (now - t0)

    def positions_text(self, width: int | None = None) -> str:
        """The first MAX_POSITIONS stream positions, as many as fit one line of `width`
        characters (None: any width), the rest counted (`… +N more`)."""
        try:
            items = list(self.positions.items())
        except RuntimeError:  # mutated while we looked: show it next time
            return ""
        if not items:
            return ""
        label = "last seqno" if self.protocol == "dcp" else "tokens"
        items.sort(key=lambda kv: (str(type(kv[0])), kv[0]))
        shown = items[:MAX_POSITIONS]
        if self.protocol == "dcp":
            texts = [f"vb{k}={v}" for k, v in shown]
        else:
            texts = [f"{k}={v}" for k, v in shown]
        return f"{label}: " + fit_items(texts, len(items), None if width is None else width - len(label) - 2)


def fit_items(texts: list[str], total: int, width: int | None, sep: str = "  ") -> str:
    """`texts` joined by `sep`, as many as fit `width` characters (None: all of them) with
    `… +N more` for the rest of `total`; an item is never cut."""
    out: list[str] = []
    used = 0
    for i, t in enumerate(texts):
        rest = total - i - 1
        tail = len(f"{sep}\u2026 +{rest} more") if rest else 0
        add = len(t) + (len(sep) if out else 0)
        if width is not None and used + add + tail > width:
            break
        out.append(t)
        used += add
    text = sep.join(out)
    if len(out) < total:
        text += f"{sep if out else ''}\u2026 +{total - len(out)} more"
    return text
