"""Durable writes (sync writes) in the DCP rules of REPLAY.md, for DcpState (replay/rules/dcp.py:
the grouped rules Spark's applyInArrow runs per group of vbuckets). Both engines' `documents`
and `history` tables take the same rule as SQL (replay/rules/plans.py).

A prepare is not a document change: it is remembered per document (vbucket,
collection_id, key). A commit is the document change, at the commit's seqno, with the
columns of the last prepare of that document received before it (and not undone by a
rollback): rev_seqno, cas, datatype, item_flags, expiration, value_len. A commit whose
prepare is not in the capture keeps its own columns. An abort never changes a document.

`collect` (no state, any thread) takes a chunk's prepares and commits; `Prepares.resolve`
(in frame order) remembers the prepares and patches the commits among a chunk's changes.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dcptool.replay.rules.columns import as_numpy
from dcptool.replay.rules.doc_state import NULLABLE, owners

SYNC_OPS = ("prepare", "commit", "abort")
# ops that change a document (commit: as the prepare it commits)
DOC_CHANGE_OPS = ("mutation", "deletion", "expiration", "commit")
# the columns a commit takes from its prepare
FROM_PREPARE = ("rev_seqno", "cas", "datatype", "item_flags", "expiration", "value_len")
_BITS = np.uint16(sum(1 << NULLABLE.index(f) for f in FROM_PREPARE))


def collect(chunk: pa.Table, rows: np.ndarray, is_prepare: np.ndarray):
    """The prepares and commits `rows` of `chunk` (frame order, not undone), for resolve():
    (owner, key, seq, is_prepare, the FROM_PREPARE values, their valid bits), or None."""
    if len(rows) == 0:
        return None
    sub = chunk.take(pa.array(rows))
    cid = sub.column("collection_id")
    owner = owners(as_numpy(sub.column("vbucket"), dtype=np.int64), as_numpy(cid, fill=0, dtype=np.int64),
                   as_numpy(cid.is_valid(), dtype=bool))
    valid = np.zeros(len(rows), np.uint16)
    values = {}
    for f in FROM_PREPARE:
        col = sub.column(f)
        values[f] = as_numpy(col, fill=0, dtype=np.uint64 if f == "cas" else np.int64)
        valid |= np.where(as_numpy(col.is_valid(), dtype=bool), np.uint16(1 << NULLABLE.index(f)), np.uint16(0))
    return (owner, sub.column("key").to_pylist(), as_numpy(sub.column("_seq"), dtype=np.int64),
            is_prepare[rows], values, valid)


class Prepares:
    """The last prepare of each document seen so far (few: durable writes are rare)."""

    def __init__(self):
        self.last: dict[tuple, tuple] = {}

    def resolve(self, collected, changes) -> None:
        """Remember the chunk's prepares; give its commits in `changes` (doc_state.Changes,
        or None) their prepare's columns."""
        if collected is None:
            return
        owner, keys, seq, is_prep, values, valid = collected
        found: dict[int, tuple] = {}      # commit _seq -> its prepare's (values, valid)
        for i in range(len(seq)):
            doc = (int(owner[i]), keys[i])
            if is_prep[i]:
                self.last[doc] = (tuple(values[f][i] for f in FROM_PREPARE), valid[i])
            else:
                p = self.last.get(doc)
                if p is not None:
                    found[int(seq[i])] = p
        if not found or changes is None:
            return
        rec = changes.rec
        at = np.flatnonzero(np.isin(rec["seq"], np.fromiter(found, np.int64, len(found))))
        for j in at:
            vals, bits = found[int(rec["seq"][j])]
            for f, v in zip(FROM_PREPARE, vals):
                rec[f][j] = v
            rec["valid"][j] = (rec["valid"][j] & ~_BITS) | bits

