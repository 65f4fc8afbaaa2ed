"""The Synapse checks of `dcptool verify`, per (stream, instance), in replay order, with the
rules of REPLAY.md (the same ones `replay` builds `positions` and `gaps` with):

* RDATA with token `batch` waits for the next numeric RDATA of its stream and instance on
  the same connection; a reconnect leaves waiting rows without a token (`batch_dropped`);
* a numeric RDATA token lower than the committed token (the last one set by an RDATA or a
  POSITION) is out of order;
* POSITION `prev new`: a committed token below `prev` means rows between them were never
  seen (a gap, also across reconnects, where the new connection's first POSITION tells);
  `new` below `prev` is a malformed position.

Caught-up lines (direction `catch-up`, replay/rules/synapse_catchup.py): the ranges their
POSITION lines vouch for fill gaps, so a gap is reported at the end only when no fetched range
covers it; a live RDATA below the committed token inside a fetched range is the writer's late
copy of a row already fetched, not an order error.

Only RDATA and POSITION lines coming in are looked at one by one (the other lines are
skipped with one vectorised mask)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dcptool.protocol.synapse.cover import CATCH_UP, Cover
from dcptool.replay.check.findings import Findings, Where
from dcptool.replay.rules.columns import as_numpy, lookup_codes

COLUMNS = ["capture_id", "frame_no", "conn", "direction", "command", "stream", "instance", "token",
           "batch", "prev_token", "new_token", "decode_error"]


class _Group:
    __slots__ = ("token", "waiting", "waiting_conn", "waiting_where", "waiting_frame")

    def __init__(self):
        self.token: int | None = None   # the committed token
        self.waiting = 0                # batch rows waiting for their token
        self.waiting_conn = -1
        self.waiting_where: Where | None = None
        self.waiting_frame = None


class SynapseChecker:
    COLUMNS = COLUMNS

    def __init__(self):
        self.groups: dict[tuple, _Group] = {}
        self.last_conn = -1
        self.cover = Cover()                 # ranges caught up, per (stream, instance)
        self.gaps: list[tuple] = []          # (where, key, from, to, message, loc): said at the end

    def resync(self) -> None:
        """Rows were lost: waiting batch rows may have lost their token line; forget them."""
        for g in self.groups.values():
            g.waiting = 0

    def finish(self, out: Findings) -> None:
        for where, key, lo, hi, message, loc in self.gaps:
            if not self.cover.covers(key, lo, hi):
                out.at(where, "synapse.position_gap", message, token=hi, **loc)
        self.gaps = []
        for key, g in self.groups.items():
            if g.waiting and g.waiting_conn < self.last_conn:
                self._dropped(key, g, out)

    def feed(self, t: pa.Table, raw, where: Where, out: Findings) -> None:
        if t.num_rows == 0:
            return
        err = as_numpy(t.column("decode_error").is_valid(), dtype=bool)
        fn = as_numpy(t.column("frame_no"), fill=0, dtype=np.int64)
        if err.any():
            msgs = t.column("decode_error")
            for i in np.flatnonzero(err).tolist():
                out.at(where, "synapse.decode_error", f"line did not decode: {msgs[i].as_py()}",
                       frame_no=int(fn[i]))
        conn = as_numpy(t.column("conn"), fill=0, dtype=np.int64) | (where.rank << 32)
        self.last_conn = max(self.last_conn, int(conn.max()))
        is_in, caught = lookup_codes(t.column("direction"), {"in"}, {CATCH_UP})
        is_rdata, is_pos = lookup_codes(t.column("command"), {"RDATA"}, {"POSITION"})
        named = ~err & as_numpy(t.column("stream").is_valid(), dtype=bool)
        if (caught & is_pos & named).any():
            self._cover(t, caught & is_pos & named)
        keep = is_in & (is_rdata | is_pos) & named
        rows = np.flatnonzero(keep)
        if not len(rows):
            return
        sel = t.take(pa.array(rows)).select(["stream", "instance", "command", "token", "batch",
                                             "prev_token", "new_token"]).to_pydict()
        conns = conn[rows].tolist()
        frames = fn[rows].tolist()
        for j, (stream, inst, cmd, token, batch, prev, new) in enumerate(zip(
                sel["stream"], sel["instance"], sel["command"], sel["token"], sel["batch"],
                sel["prev_token"], sel["new_token"])):
            key = (stream, inst)
            g = self.groups.get(key)
            if g is None:
                g = self.groups[key] = _Group()
            c, frame = conns[j], frames[j]
            if g.waiting and g.waiting_conn != c:
                self._dropped(key, g, out)
            loc = dict(frame_no=frame, stream=stream, instance=inst)
            if cmd == "RDATA":
                if batch:
                    if not g.waiting:
                        g.waiting_conn, g.waiting_where, g.waiting_frame = c, where, frame
                    g.waiting += 1
                    continue
                if token is None:
                    continue
                if g.token is not None and token < g.token and not self.cover.within(key, token):
                    out.at(where, "synapse.token_out_of_order", f"{stream}/{inst}: RDATA token {token} "
                           f"below the committed token {g.token}", token=token, **loc)
                g.token, g.waiting = token, 0
                continue
            if prev is not None and new is not None and new < prev:
                out.at(where, "synapse.position_backwards", f"{stream}/{inst}: POSITION {prev} {new} "
                       "goes back", token=new, **loc)
            if prev is not None and g.token is not None and g.token < prev:
                self.gaps.append((where, key, g.token, prev, f"{stream}/{inst}: POSITION prev {prev} above the "
                                  f"committed token {g.token}: rows {g.token + 1}..{prev} never seen", loc))
            if new is not None:
                g.token = new

    def _cover(self, t: pa.Table, mask: np.ndarray) -> None:
        sel = t.take(pa.array(np.flatnonzero(mask))).select(["stream", "instance", "prev_token",
                                                             "new_token"]).to_pydict()
        for s, i, a, b in zip(sel["stream"], sel["instance"], sel["prev_token"], sel["new_token"]):
            if a is not None and b is not None:
                self.cover.add((s, i), a, b)

    @staticmethod
    def _dropped(key: tuple, g: _Group, out: Findings) -> None:
        out.at(g.waiting_where, "synapse.batch_dropped", f"{key[0]}/{key[1]}: {g.waiting} batch row(s) "
               "never got their token (the connection ended)", frame_no=g.waiting_frame,
               stream=key[0], instance=key[1])
        g.waiting = 0
