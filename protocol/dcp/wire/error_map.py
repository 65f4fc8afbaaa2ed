"""The producer's answer to GET_ERROR_MAP (0xfe), sans-IO: an error map in the JSON layout of
kv_engine's error_map_v2 (version, revision, errors keyed by the status in lower-case hex,
each with name, desc and attrs), covering the statuses this producer sends. SDK cores use the
attrs to decide retries ("fetch-config" on NOT_MY_VBUCKET, "auto-retry" on temporary
failures)."""

from __future__ import annotations

import json

from dcptool.protocol.dcp.wire.constants import Status

_ERRORS = {
    Status.SUCCESS: ("SUCCESS", "Success", ["success"]),
    Status.KEY_ENOENT: ("KEY_ENOENT", "Not Found", ["item-only"]),
    Status.KEY_EEXISTS: ("KEY_EEXISTS", "key already exists, or CAS mismatch", ["item-only"]),
    Status.EINVAL: ("EINVAL", "Invalid packet", ["internal"]),
    Status.NOT_MY_VBUCKET: ("NOT_MY_VBUCKET", "Server which received this command is not the master for the "
                            "vbucket", ["fetch-config", "invalid-input"]),
    Status.NO_BUCKET: ("NO_BUCKET", "Not connected to a bucket", ["conn-state-invalidated"]),
    Status.AUTH_STALE: ("AUTH_STALE", "Reauthentication required", ["conn-state-invalidated", "auth"]),
    Status.AUTH_ERROR: ("AUTH_ERROR", "Authentication failed", ["conn-state-invalidated", "auth"]),
    Status.AUTH_CONTINUE: ("AUTH_CONTINUE", "Authentication continue", ["special-handling", "auth"]),
    Status.ERANGE: ("ERANGE", "Range error", ["invalid-input"]),
    Status.ROLLBACK: ("ROLLBACK", "Rollback required", ["special-handling"]),
    Status.EACCESS: ("EACCESS", "No access", ["conn-state-invalidated", "auth"]),
    Status.UNKNOWN_COMMAND: ("UNKNOWN_COMMAND", "Unknown command", ["support"]),
    Status.NOT_SUPPORTED: ("NOT_SUPPORTED", "Not supported", ["support"]),
    Status.EINTERNAL: ("EINTERNAL", "Internal error", ["internal"]),
    Status.EBUSY: ("EBUSY", "Server too busy", ["temp", "retry-later"]),
    Status.ETMPFAIL: ("ETMPFAIL", "Temporary failure", ["temp", "retry-later"]),
}


def error_map(requested_version: int) -> tuple[int, bytes]:
    """(status, body) for a GET_ERROR_MAP asking for `requested_version`."""
    if requested_version < 1:
        return Status.EINVAL, b""
    version = min(requested_version, 2)
    errors = {format(int(code), "x"): {"name": name, "desc": desc, "attrs": attrs}
              for code, (name, desc, attrs) in _ERRORS.items()}
    doc = {"version": version, "revision": 1, "errors": errors}
    return Status.SUCCESS, json.dumps(doc, separators=(",", ":")).encode()
