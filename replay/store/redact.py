"""Credentials never reach a capture: option keys that name secrets are dropped from the
recorded options, and SASL AUTH/STEP payloads (any request magic, flexible framing included)
are replaced by `*` bytes of the same length (CAPTURE_FORMAT.md, column `raw`). The one
masker: `stream --raw` uses it too."""

from __future__ import annotations

import re

_SECRET_KEY = re.compile(r"pass(word|wd|phrase)?$|secret|credential|api[_-]?key|private[_-]?key",
                         re.IGNORECASE)


def strip_secrets(options):
    """A copy of `options` without keys that name a secret (password, secret, api key ...),
    at any depth. The caller is expected to pass no secret; this is a second fence."""
    if isinstance(options, dict):
        return {str(k): strip_secrets(v) for k, v in options.items()
                if not _SECRET_KEY.search(str(k))}
    if isinstance(options, (list, tuple)):
        return [strip_secrets(v) for v in options]
    return options


_SASL_OPCODES = (0x21, 0x22)      # SASL_AUTH, SASL_STEP
_SASL_MAGICS = (0x80, 0x08)       # request, request with flexible framing


def mask_sasl_credentials(raw: bytes) -> bytes:
    """For a SASL AUTH/STEP request frame, the same frame with its value replaced by `*`
    bytes of the same length (header, extras and key, i.e. the mechanism, are kept). Any
    other frame, or a frame too short to parse, is returned unchanged."""
    if len(raw) < 24 or raw[0] not in _SASL_MAGICS or raw[1] not in _SASL_OPCODES:
        return raw
    if raw[0] == 0x08:
        framing, key_len = raw[2], raw[3]
    else:
        framing, key_len = 0, int.from_bytes(raw[2:4], "big")
    ext_len = raw[4]
    body_len = int.from_bytes(raw[8:12], "big")
    start = 24 + framing + ext_len + key_len
    end = min(24 + body_len, len(raw))
    if start >= end:
        return raw
    return raw[:start] + b"*" * (end - start) + raw[end:]
