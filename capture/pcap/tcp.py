"""TCP reassembly of one direction of a connection (sans-IO): segments in capture order go
in, the byte stream comes out in order, with explicit gaps where the capture lost bytes.

Sequence numbers are unwrapped to 64-bit stream offsets. A segment wholly before what was
delivered is a retransmission (dropped); one that overlaps it gives only its new bytes; one
after a hole waits. A hole is declared lost, never guessed, when the peer acknowledges
bytes beyond it (the endpoint got them, the capture did not), when the connection ends,
when more than `max_pending` bytes wait behind it, or when the importer gives it up because
the bytes waiting in all directions together passed their `Pool`'s limit (`skip_hole`)."""

from __future__ import annotations

DATA, GAP = 0, 1
MAX_PENDING = 16 * 2**20        # bytes one direction holds behind a hole
POOL_LIMIT = 64 * 2**20         # bytes all directions of an import hold behind holes


class Pool:
    """The bytes waiting behind holes over every direction that shares it (and the most
    seen at once), so that many connections with holes still hold a bounded amount."""

    def __init__(self, limit: int = POOL_LIMIT):
        self.limit = limit
        self.bytes = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.bytes += n
        self.peak = max(self.peak, self.bytes)


class Direction:
    def __init__(self, max_pending: int = MAX_PENDING, pool: Pool | None = None):
        self.next: int | None = None      # the stream offset expected next (unwrapped)
        self.base = 0                     # the raw sequence number of offset `next` at start
        self.pending: dict[int, bytes] = {}
        self.pending_bytes = 0
        self.max_pending = max_pending
        self.pool = pool if pool is not None else Pool()
        self.saw_syn = False
        self.retransmitted = 0
        self.lost_bytes = 0
        self.gaps = 0
        self.fin_at: int | None = None    # the offset of this direction's FIN (it takes one number)

    def _offset(self, seq: int) -> int:
        """seq unwrapped to the offset nearest to `next` (the stream has started)."""
        nxt = self.next
        assert nxt is not None, "a started stream"
        cur = (self.base + nxt) & 0xFFFFFFFF
        d = ((seq - cur + 0x80000000) & 0xFFFFFFFF) - 0x80000000
        return nxt + d

    def syn(self, seq: int) -> None:
        if self.next is None:
            self.saw_syn = True
            self.base, self.next = (seq + 1) & 0xFFFFFFFF, 0

    def in_order(self, seq: int, n: int) -> bool:
        """The common case in one step: a segment of n bytes starting exactly where the
        stream is, nothing waiting: the stream moves past it and the caller delivers it
        whole. False: use `segment`."""
        if self.pending or self.next is None or seq != (self.base + self.next) & 0xFFFFFFFF:
            return False
        self.next += n
        return True

    def is_acked(self, ack: int) -> bool:
        """An ACK of exactly what this direction delivered (nothing for `acked` to do)."""
        return not self.pending and self.next is not None and ack == (self.base + self.next) & 0xFFFFFFFF

    def segment(self, seq: int, payload: bytes, out: list) -> None:
        """Add a segment's payload; appends (DATA, bytes) and (GAP, n) items to out."""
        if not payload:
            return
        if self.next is None:          # first data without its SYN: the stream starts here
            self.base, self.next = seq, 0
        start = self._offset(seq)
        end = start + len(payload)
        if end <= self.next:
            self.retransmitted += 1
            return
        if start > self.next:
            old = self.pending.get(start)
            if old is None or len(old) < len(payload):
                grown = len(payload) - (len(old) if old else 0)
                self.pending_bytes += grown
                self.pool.add(grown)
                self.pending[start] = bytes(payload)   # a copy: a view would pin its file block
            if self.pending_bytes > self.max_pending:
                self._skip_to(min(self.pending), out)
            return
        out.append((DATA, payload[self.next - start:] if start < self.next else payload))
        self.next = end
        self._drain(out)

    def _drain(self, out: list) -> None:
        nxt = self.next
        assert nxt is not None, "a started stream"
        while self.pending:
            start = min(self.pending)
            if start > nxt:
                return
            data = self.pending.pop(start)
            self.pending_bytes -= len(data)
            self.pool.add(-len(data))
            end = start + len(data)
            if end > nxt:
                out.append((DATA, data[nxt - start:]))
                self.next = nxt = end

    def _skip_to(self, offset: int, out: list) -> None:
        nxt = self.next
        assert nxt is not None, "a started stream"
        if offset > nxt:
            n = offset - nxt
            out.append((GAP, n))
            self.gaps += 1
            self.lost_bytes += n
            self.next = offset
        self._drain(out)

    def fin(self, seq: int, length: int) -> None:
        if self.next is not None and self.fin_at is None:
            self.fin_at = self._offset(seq) + length

    def acked(self, ack: int, out: list) -> None:
        """The peer acknowledged up to `ack`: a hole below it will never be filled."""
        if self.next is None:
            return
        off = self._offset(ack)
        if self.fin_at is not None:
            off = min(off, self.fin_at)
        if off <= self.next:
            return
        if self.pending:
            self._skip_to(min(min(self.pending), off), out)
        else:
            self._skip_to(off, out)

    def skip_hole(self, out: list) -> None:
        """The first hole is lost: deliver what waited behind it (up to the next hole)."""
        if self.pending:
            self._skip_to(min(self.pending), out)

    def finish(self, out: list) -> None:
        """The connection ended: every hole left is lost."""
        while self.pending:
            self._skip_to(min(self.pending), out)
