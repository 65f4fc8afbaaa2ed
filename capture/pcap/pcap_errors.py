"""The typed errors of pcap import and export (cli/ maps them to exit codes)."""

from __future__ import annotations

from dcptool.protocol.errors import ErrorCode, LateUsageError, LocalError


class NotAPacketFile(LateUsageError):
    """The file is neither pcap nor pcapng (exit 2)."""


class UndecodablePcap(LocalError):
    """A packet file of which nothing can be decoded (exit 5)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.TRUNCATED, message)
