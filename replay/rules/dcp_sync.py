"""Durable writes (sync writes) in the DCP rules of REPLAY.md: for the local engine's
DcpState, and as Spark SQL for spark.py `_dcp_documents`.

A prepare is not a document change: it is remembered per document (vbucket,
collection_id, key). A commit is the document change, at the commit's seqno, with the
columns of the last prepare of that document received before it (and not undone by a
rollback): rev_seqno, cas, datatype, item_flags, expiration, value_len. A commit whose
prepare is not in the capture keeps its own columns. An abort never changes a document.

`collect` (no state, any thread) takes a chunk's prepares and commits; `Prepares.resolve`
(in frame order) remembers the prepares and patches the commits among a chunk's changes;
`spark_with_prepares` is the same rule over Spark DataFrames.
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


def spark_with_prepares(F, changes, prepares):
    """The changes with each commit's columns taken from the last prepare of its document
    received before it (FROM_PREPARE; a commit without one keeps its own): the rule of
    `Prepares` in Spark SQL, for spark.py `_dcp_documents`. `F` is pyspark.sql.functions
    (only spark.py imports pyspark)."""
    cols = FROM_PREPARE + (("_cas_bits",) if "_cas_bits" in changes.columns else ())   # cas as a long too
    p = prepares.select(F.col("vbucket").alias("_p_vb"), F.col("collection_id").alias("_p_cid"),
                        F.col("key").alias("_p_key"), F.col("_seq").alias("_p_seq"),
                        *[F.col(c).alias("_p_" + c) for c in cols])
    commits = changes.filter(F.col("op") == "commit").select("vbucket", "collection_id", "key", "_seq")
    same = ((F.col("vbucket") == F.col("_p_vb")) & F.col("collection_id").eqNullSafe(F.col("_p_cid"))
            & (F.col("key") == F.col("_p_key")) & (F.col("_p_seq") < F.col("_seq")))
    found = (commits.join(p, same, "inner").groupBy(F.col("_seq").alias("_c_seq"))
             .agg(*[F.max_by("_p_" + c, "_p_seq").alias("_c_" + c) for c in cols]))
    # commits are few next to the changes: broadcast them rather than shuffle every change
    joined = changes.join(F.broadcast(found), F.col("_seq") == F.col("_c_seq"), "left")
    hit = F.col("_c_seq").isNotNull()
    return joined.select(*[F.when(hit, F.col("_c_" + c)).otherwise(F.col(c)).alias(c) if c in cols else F.col(c)
                           for c in changes.columns])
