"""Typed protocol errors shared by every protocol module.

Every error carries a code so that tests and callers branch on the code, never the text,
and a side: REMOTE when the peer sent something invalid, LOCAL when we would send
something invalid. Only cli/ turns these into exit codes.

`DcptoolError` is the one base of every exception class of the project (protocol/,
replay/, capture/, cli/; tests/test_architecture.py checks it). cli/exit_codes.py maps its
subclasses to exit codes in one table.
"""

from __future__ import annotations

import enum

from dcptool.protocol.text import printable


class DcptoolError(Exception):
    """The base of every exception class of dcptool."""


class Interrupted(DcptoolError):
    """Raised by a run after it closed everything cleanly on a signal: Ctrl-C (SIGINT)
    exits 130, SIGTERM and SIGHUP 128 + the signal number (143, 129)."""

    def __init__(self, signum: int = 2):
        super().__init__(signum)
        self.signum = int(signum)


class LateUsageError(DcptoolError):
    """A usage error found only after connecting (an option the server's answer rules out,
    e.g. --vbuckets beyond the bucket's) or in what a capture directory recorded: exit 2
    with one line."""


class BadSource(LateUsageError, ValueError):
    """A SOURCE URL that cannot be used (capture/sources.py); `hint` names the argument."""

    def __init__(self, message: str, hint: str = "SOURCE"):
        super().__init__(message)
        self.hint = hint


class Side(enum.Enum):
    LOCAL = "local"    # we would send something invalid
    REMOTE = "remote"  # the peer sent something invalid


class ErrorCode(enum.IntEnum):
    # framing
    BAD_MAGIC = 1            # first header byte is no memcached magic
    BODY_TOO_LARGE = 2       # a length field above the configured cap
    BAD_LENGTHS = 3          # extras + key + framing extras exceed the body length
    TRUNCATED = 4            # the stream ended inside a frame
    BAD_FRAMING_EXTRAS = 5   # a flexible-framing element runs past its section
    BAD_LEB128 = 6           # a collection id prefix is not valid unsigned LEB128
    BAD_EXTRAS = 7           # extras of the wrong size for the opcode
    BAD_VBUCKET = 8          # a vbucket id outside what a bucket can have (0-1023) or was asked for
    # consumer / producer state machines
    UNEXPECTED_MESSAGE = 20  # a message that is not valid in the current state
    STATUS = 21              # the peer answered with a status we cannot continue from
    AUTH_FAILED = 22         # SASL refused or the server signature did not verify
    DEAD_CONNECTION = 23     # nothing received for too long
    UNSUPPORTED = 24         # the peer lacks something we require
    TIMEOUT = 25             # no answer to a request, or a frame stopped half way, within the timeout
    SASL_LIMIT = 26          # the server's SASL exchange exceeds our bounds (rounds, SCRAM iterations)
    BAD_CLUSTER_CONFIG = 27  # a cluster config (bucket map) that is not JSON or lacks a required field
    # Synapse line protocol
    LINE_TOO_LONG = 40       # a line above the cap
    BAD_COMMAND = 41         # a known command whose arguments do not parse
    SERVER_NAME_MISMATCH = 42  # SERVER announced another name than expected
    SERVER_ERROR = 43        # the server sent ERROR
    INVALID_UTF8 = 44        # a line that is not UTF-8
    BAD_CATCH_UP = 45        # a writer's catch-up answer (get_repl_stream_updates) that is not what was asked


class ProtocolError(DcptoolError):
    """A protocol violation. ``status`` is the DCP status when the peer sent one."""

    def __init__(self, code: ErrorCode, message: str, side: Side = Side.REMOTE,
                 status: int | None = None):
        super().__init__(message)
        self.code = code
        self.side = side
        self.status = status

    @property
    def message(self) -> str:
        return str(self.args[0])


class RemoteError(ProtocolError):
    def __init__(self, code: ErrorCode, message: str, status: int | None = None):
        super().__init__(code, message, Side.REMOTE, status)


class LocalError(ProtocolError):
    def __init__(self, code: ErrorCode, message: str, status: int | None = None):
        super().__init__(code, message, Side.LOCAL, status)


class ConnectFailed(DcptoolError):
    """Could not connect: refused, DNS failure, timeout, TLS handshake failure."""


class ConnectionLost(DcptoolError):
    """An established connection ended unexpectedly and could not be recovered."""


class AuthRefused(ProtocolError):
    """The server refused our credentials or denied access (SASL, bucket, privileges)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(ErrorCode.AUTH_FAILED, message, Side.REMOTE, status)


def one_line(exc: BaseException) -> str:
    """The one line that tells an error (CLI.md: a clear one-line error). Messages quote
    what the server sent (mechanism lists, error texts, names): control characters and
    terminal escapes come out escaped."""
    if isinstance(exc, ProtocolError):
        extra = f" (status 0x{exc.status:02x})" if exc.status is not None else ""
        return printable(f"{exc.message}{extra}")
    text = str(exc) or type(exc).__name__
    line = text.splitlines()[0] if text.strip() else type(exc).__name__
    # a library's message may carry raw bytes of the damaged input: show them escaped
    return printable(line)
