"""Line framing for Synapse's TCP replication: lines end in b"\\n" and may hold at most
``max_line`` bytes before it (Synapse inherits Twisted's 16384-byte cap).

Splitting is done in bulk with ``bytes.split`` over everything received, so the cost per
line stays in C. A line over the cap is a remote error (LINE_TOO_LONG); the complete lines
received before it are still handed out, and the error is left in ``error`` for the caller
to act on (record, close the connection)."""

from __future__ import annotations

from dcptool.protocol.errors import ErrorCode, RemoteError

MAX_LINE = 16384


class LineFramer:
    def __init__(self, max_line: int = MAX_LINE):
        self.max_line = max_line
        self._buf = b""
        self.error: RemoteError | None = None
        self.overlong: bytes = b""  # the start of the line that broke the cap

    @property
    def pending(self) -> int:
        """Bytes of an incomplete line held back."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return the complete lines (without newline), in order.
        After an error, nothing more is accepted."""
        if self.error is not None:
            return []
        buf = self._buf + data if self._buf else bytes(data)
        end = buf.rfind(b"\n")
        if end < 0:
            self._buf = buf
            self._check_tail()
            return []
        lines = buf[:end].split(b"\n")
        self._buf = buf[end + 1:]
        if max(map(len, lines)) > self.max_line:
            for i, line in enumerate(lines):
                if len(line) > self.max_line:
                    self._fail(line)
                    return lines[:i]
        self._check_tail()
        return lines

    def feed_block(self, data: bytes) -> bytes:
        """Like ``feed`` but returns the complete lines as one block of bytes (each line
        with its newline), for bulk.Scan; b"" when no line is complete. On an over-long
        line the block holds the lines before it and ``error`` is set."""
        if self.error is not None:
            return b""
        buf = self._buf + data if self._buf else bytes(data)
        end = buf.rfind(b"\n")
        if end < 0:
            self._buf = buf
            self._check_tail()
            return b""
        block = buf[:end + 1]
        self._buf = buf[end + 1:]
        if end > self.max_line:
            import numpy as np
            nl = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
            lens = np.diff(nl, prepend=-1) - 1
            over = np.flatnonzero(lens > self.max_line)
            if len(over):
                i = int(over[0])
                start = int(nl[i - 1]) + 1 if i else 0
                self._fail(block[start:int(nl[i])])
                return block[:start]
        self._check_tail()
        return block

    def _check_tail(self) -> None:
        if len(self._buf) > self.max_line:
            self._fail(self._buf)

    def _fail(self, line: bytes) -> None:
        self.overlong = bytes(line)
        self._buf = b""
        self.error = RemoteError(
            ErrorCode.LINE_TOO_LONG,
            f"the server sent a line longer than {self.max_line} bytes "
            f"(at least {len(line)} bytes); closing the connection")

    def eof(self) -> bytes:
        """The connection ended: return (and drop) an unterminated last line, if any."""
        rest, self._buf = self._buf, b""
        return rest
