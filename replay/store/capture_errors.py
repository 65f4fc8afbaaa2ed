"""The errors of reading a capture at rest (reader.py raises them, and names them for its
callers: reader.CaptureError ...)."""

from __future__ import annotations

from dcptool.protocol.errors import DcptoolError, LateUsageError


class CaptureError(DcptoolError):
    """A path that is not a readable capture, or captures that cannot be replayed together."""


class UnsupportedFormat(CaptureError, LateUsageError):
    """A segment whose `dcptool.format` this build cannot read (a newer one): refused, never
    read as if it were known. A usage error (exit 2): the capture needs a newer dcptool."""


class NotACapture(CaptureError):
    """A file that holds no dcptool capture (no dcptool.* metadata, or not Parquet/Arrow)."""


class OutputIsCapture(LateUsageError):
    """An output path that is a capture file or inside a capture directory (outputs.py): refused
    before anything is written, a usage error (exit 2)."""
