"""Caught-up rows in the Synapse rules (REPLAY.md "Caught-up rows"): what `capture --catch-up`
fetched from a stream's writer over HTTP, recorded with the direction `catch-up`
(protocol/synapse/catchup.py, capture/synapse_catchup.py).

The book holds, per (stream, instance), the caught-up rows (each with the token it commits
under: a `batch` row takes the token of the next numeric row of its page) and the token ranges
the writer vouched for (the page's closing POSITION). The rules then:
- count a caught-up row as a row of its stream and token, as if it had come live (it sets no
  token: the live POSITION that showed the gap already did);
- drop a live row equal to a caught-up one (same stream, instance, token and row JSON: the
  writer published it late, or a resumed capture fetched it again): every row once;
- keep a POSITION gap only when no fetched range covers it: the `gaps` table lists what could
  not be fetched.
Both engines and `verify` build the same book from the same lines.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dcptool.protocol.synapse.cover import CATCH_UP, Cover, Key
from dcptool.replay.rules.columns import as_strings, equals

BOOK_COLUMNS = ["capture_id", "frame_no", "direction", "command", "stream", "instance", "token",
                "batch", "prev_token", "new_token", "row"]


def caught_mask(t: pa.Table) -> np.ndarray:
    return equals(t.column("direction"), CATCH_UP)


class CatchUpBook:
    def __init__(self) -> None:
        self.cover = Cover()
        self.rows: dict[Key, set[tuple[int, str]]] = {}
        self.lines: dict[tuple[str, int], tuple[int, bool]] = {}   # (capture_id, frame_no) -> (token, closes a batch)
        self.count = 0

    def __bool__(self) -> bool:
        return bool(self.lines) or bool(self.cover.ranges)

    def add(self, t: pa.Table) -> None:
        """Caught-up lines (BOOK_COLUMNS) in capture order."""
        t = t.filter(pa.array(caught_mask(t))) if t.num_rows else t
        if not t.num_rows:
            return
        d = t.select(BOOK_COLUMNS).to_pydict()
        waiting: dict[Key, list[tuple[tuple[str, int], str]]] = {}
        for cid, fno, cmd, stream, inst, tok, batch, prev, new, row in zip(
                d["capture_id"], d["frame_no"], d["command"], d["stream"], d["instance"], d["token"],
                d["batch"], d["prev_token"], d["new_token"], d["row"]):
            if stream is None:
                continue
            key = (stream, inst)
            if cmd == "POSITION" and prev is not None and new is not None:
                self.cover.add(key, prev, new)
            elif cmd == "RDATA":
                if batch or tok is None:
                    waiting.setdefault(key, []).append(((cid, fno), row))
                    continue
                before = waiting.pop(key, [])
                for ident, brow in before:
                    self._row(key, ident, tok, brow, False)
                self._row(key, (cid, fno), tok, row, bool(before))

    def _row(self, key: Key, ident: tuple[str, int], token: int, row: str, closes: bool) -> None:
        self.lines[ident] = (token, closes)
        self.rows.setdefault(key, set()).add((token, row))
        self.count += 1

    def lookup(self, t: pa.Table, caught: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For the caught-up lines of `t` (mask `caught`): (token each commits under, whether
        it commits, whether it closes a batch), as full-length arrays."""
        n = t.num_rows
        tok = np.zeros(n, np.int64)
        ok = np.zeros(n, bool)
        closes = np.zeros(n, bool)
        idx = np.flatnonzero(caught)
        if len(idx):
            take = pa.array(idx)
            cids = as_strings(t.column("capture_id")).take(take).to_pylist()
            fnos = t.column("frame_no").take(take).to_pylist()
            for j, cid, fno in zip(idx.tolist(), cids, fnos):
                hit = self.lines.get((cid, fno))
                if hit is not None:
                    tok[j], closes[j] = hit
                    ok[j] = True
        return tok, ok, closes

    def duplicates(self, t: pa.Table, candidates: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Live rows (mask `candidates`, committing under `tokens`) equal to a caught-up row."""
        out = np.zeros(t.num_rows, bool)
        if not self.rows:
            return out
        idx = np.flatnonzero(candidates)
        if not len(idx):
            return out
        take = pa.array(idx)
        streams = as_strings(t.column("stream")).take(take).to_pylist()
        insts = as_strings(t.column("instance")).take(take).to_pylist()
        rows = t.column("row").take(take).to_pylist() if "row" in t.column_names else [None] * len(idx)
        for j, s, i, r in zip(idx.tolist(), streams, insts, rows):
            have = self.rows.get((s, i))
            if have and (int(tokens[j]), r) in have:
                out[j] = True
        return out

    def open_gaps(self, gaps: pa.Table) -> pa.Table:
        """The rows of a `gaps` table that no fetched range covers."""
        if not gaps.num_rows or not self.cover.ranges:
            return gaps
        s = gaps.column("stream").to_pylist()
        i = gaps.column("instance").to_pylist()
        a = gaps.column("from_token").to_pylist()
        b = gaps.column("to_token").to_pylist()
        keep = [not self.cover.covers((s[k], i[k]), a[k], b[k]) for k in range(gaps.num_rows)]
        return gaps.filter(pa.array(keep, pa.bool_()))


def gap_counts(gaps: pa.Table, names: list[Key]) -> np.ndarray:
    """Gaps per (stream, instance) of `names`, from a `gaps` table."""
    index = {k: g for g, k in enumerate(names)}
    out = np.zeros(len(names), np.int64)
    for s, i in zip(gaps.column("stream").to_pylist(), gaps.column("instance").to_pylist()):
        g = index.get((s, i))
        if g is not None:
            out[g] += 1
    return out


