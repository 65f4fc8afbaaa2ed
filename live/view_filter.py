"""Which rows `stream` prints, without the CLI (issue 39): `--ops LIST` and `--key GLOB`
filter the rows of every format (a table, text, JSON lines; `capture` records everything and
takes neither), and the live table on a terminal leaves out the connection's own traffic
(the handshake, stream requests and their answers, noops, buffer acks, lag polls; Synapse:
NAME, PING, REPLICATE, SERVER and the POSITIONs that only repeat a token) unless `-v` or
`--ops` asks for them. live/dcp_rows.py and live/synapse_rows.py apply it."""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from dcptool.protocol.dcp.wire.constants import OP_NAMES, SERVER_OP_NAMES
from dcptool.protocol.synapse.commands import COMMANDS

# what a stream carries: the rows the live table shows by default
DCP_STREAM_OPS = frozenset({"snapshot_marker", "mutation", "deletion", "expiration", "stream_end",
                            "system_event", "prepare", "commit", "abort", "seqno_advanced",
                            "oso_snapshot", "flush", "set_vbucket_state"})
SYNAPSE_QUIET = frozenset({"NAME", "PING", "REPLICATE", "SERVER"})


def dcp_op_names() -> list[str]:
    return sorted(set(OP_NAMES.values()) | set(SERVER_OP_NAMES.values()))


def synapse_commands() -> list[str]:
    return sorted(c for c in COMMANDS if c)


def parse_ops(text: str, protocol: str) -> frozenset[str]:
    """`--ops` (comma-separated): DCP op names (`mutation,deletion`), Synapse commands in any
    case (`rdata,position`). ValueError names the unknown ones and what there is."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if protocol == "synapse":
        names = [n.upper() for n in names]
        known = synapse_commands()
    else:
        names = [n.lower() for n in names]
        known = dcp_op_names()
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        what = "Synapse commands" if protocol == "synapse" else "DCP ops"
        raise ValueError(f"{', '.join(unknown) or repr(text)}: not among the {what}: {', '.join(known)}")
    return frozenset(names)


class RowFilter:
    """`ops` (None: any), `key` (a glob, None: any) and `quiet` (the live table's default:
    the stream's own rows only; off when `ops` is given)."""

    def __init__(self, ops: frozenset[str] | None = None, key: str | None = None, quiet: bool = False):
        self.ops = ops
        self.key = key
        self.quiet = quiet and ops is None
        self._match = re.compile(fnmatch.translate(key)).match if key is not None else None

    @property
    def active(self) -> bool:
        return self.ops is not None or self.key is not None or self.quiet

    def dcp_rows(self, cols: dict[str, Any], n: int) -> list[int] | None:
        """The indexes of the DCP rows (frame_columns' lists) to print; None: every one."""
        if not self.active:
            return None
        ops = self.ops if self.ops is not None else DCP_STREAM_OPS if self.quiet else None
        keep = range(n) if ops is None else [i for i, op in enumerate(cols["op"]) if op in ops]
        if self._match is not None:
            match, keys = self._match, cols.get("key") or [None] * n
            keep = [i for i in keep if keys[i] is not None and match(keys[i])]
        return list(keep)

    def synapse_row(self, r: dict[str, Any]) -> bool:
        """Whether to print a Synapse row (its `fields` decoded: --key looks at their text)."""
        cmd = r.get("command")
        if self.ops is not None and cmd not in self.ops:
            return False
        if self.quiet and (r.get("direction") == "out" or cmd in SYNAPSE_QUIET or
                           cmd == "POSITION" and r.get("prev_token") == r.get("new_token")):
            return False
        if self._match is not None:
            fields = r.get("fields") or {}
            return any(isinstance(v, str) and self._match(v) for v in fields.values())
        return True


def pick(cols: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """frame_columns' lists with only the rows `keep`."""
    return {k: [v[i] for i in keep] if isinstance(v, list) else v for k, v in cols.items()}
