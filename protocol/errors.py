"""Typed protocol errors shared by every protocol module.

Every error carries a code so that tests and callers branch on the code, never the text,
and a side: REMOTE when the peer sent something invalid, LOCAL when we would send
something invalid. Only cli/ turns these into exit codes.
"""

from __future__ import annotations

import enum


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


class ProtocolError(Exception):
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


class ConnectFailed(Exception):
    """Could not connect: refused, DNS failure, timeout, TLS handshake failure."""


class ConnectionLost(Exception):
    """An established connection ended unexpectedly and could not be recovered."""


class AuthRefused(ProtocolError):
    """The server refused our credentials or denied access (SASL, bucket, privileges)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(ErrorCode.AUTH_FAILED, message, Side.REMOTE, status)
