"""`documents` of a DCP capture as one Spark SQL plan (no Python workers), for replay/spark/engine.py:
the rules of DcpState (replay/rules/dcp.py) as joins and one hash aggregate. The functions
take pyspark.sql.functions as `F`: only spark.py imports pyspark."""

from __future__ import annotations

import decimal

from dcptool.protocol.dcp.wire.constants import Status
from dcptool.replay.rules import dcp as dcp_rules, dcp_sync, tables as T

SEQ_SHIFT = 44     # _seq = capture rank << SEQ_SHIFT | frame_no (spark.py read_frames)


def cas_decimal(F, bits):
    """A uint64 held as the long of its bits, as the decimal(20,0) Spark reads uint64 as."""
    wide = bits.cast("decimal(21,0)")
    return F.when(bits < 0, wide + F.lit(decimal.Decimal(2**64)).cast("decimal(21,0)")).otherwise(wide) \
        .cast("decimal(20,0)")


def cas_bits(F, dec):
    """The long of the same bits as a uint64 read as decimal(20,0) (cas_decimal's inverse)."""
    return F.when(dec >= F.lit(decimal.Decimal(2**63)), dec - F.lit(decimal.Decimal(2**64))).otherwise(dec).cast("long")


def documents(F, vb_frames, ranks: dict[str, int], rollbacks: bool = True, ops: set[str] | None = None):
    """`documents` in Spark SQL alone (no Python workers): the same rules as DcpState.

    A change (mutation, deletion, expiration, commit) is undone when a later ROLLBACK answer
    of its vbucket rolls back below its by_seqno (a null by_seqno counts as -1, as in
    DcpState); each document keeps its last change that was not undone. A commit takes the
    columns of the last prepare of its document before it that was not undone
    (replay/rules/dcp_sync.py). `rollbacks=False` (the Parquet statistics show none) saves the
    scan that looks for them. `F` is pyspark.sql.functions (only spark.py imports pyspark)."""

    def not_undone(df):
        if not rollbacks:
            return df
        found = (vb_frames.filter((F.col("op") == "stream_req") & (F.col("status") == Status.ROLLBACK)
                                  & F.col("rollback_seqno").isNotNull())
                 .select(F.col("vbucket").alias("_r_vb"), F.col("_seq").alias("_r_seq"),
                         F.col("rollback_seqno").alias("_r_seqno")))
        return df.join(F.broadcast(found),
                       (F.col("vbucket") == F.col("_r_vb")) & (F.col("_r_seq") > F.col("_seq"))
                       & (F.coalesce(F.col("by_seqno"), F.lit(-1)) > F.col("_r_seqno")), "left_anti")

    alive = not_undone(vb_frames.filter(F.col("op").isin(*dcp_sync.DOC_CHANGE_OPS)))
    if ops is None or "commit" in ops:   # `ops` (ops_present): no commit, no prepare to look up
        alive = dcp_sync.spark_with_prepares(F, alive, not_undone(vb_frames.filter(F.col("op") == "prepare")))
    # a dropped collection's documents are gone (dcp_rules.without_dropped): ids are never reused
    drops = (vb_frames.filter((F.col("op") == "system_event") & (F.col("system_event_id") == dcp_rules.COLLECTION_DROP)
                              & F.col("collection_id").isNotNull())
             .select(F.col("vbucket").alias("_x_vb"), F.col("collection_id").alias("_x_cid")).distinct())
    if ops is None or "system_event" in ops:
        alive = alive.join(F.broadcast(drops), (F.col("vbucket") == F.col("_x_vb"))
                           & (F.col("collection_id") == F.col("_x_cid")), "left_anti")
    # each document's last change in one hash aggregate of numbers only (a struct, or a
    # string, would make Spark sort every change instead); fewer aggregates, less work per
    # change: frame_no and the capture come from max(_seq) (rank << 44 | frame_no), and the
    # small columns travel packed in two longs (_doc_pack)
    small, flags_exp = _doc_pack(F)
    numeric = {"by_seqno": F.col("by_seqno"), "rev_seqno": F.col("rev_seqno"),
               "cas": F.col("_cas_bits"),          # uint64 as the long of its bits (read_frames)
               "_small": small, "_flags_exp": flags_exp, "ts": F.col("ts")}
    last = alive.groupBy("vbucket", "collection_id", "key").agg(
        F.max("_seq").alias("_last"), *[F.max_by(col, F.col("_seq")).alias(name) for name, col in numeric.items()])
    by_rank = F.create_map(*[x for cid, r in ranks.items() for x in (F.lit(r).cast("long"), F.lit(cid))])
    out = {"cas": cas_decimal(F, F.col("cas")),
           "capture_id": F.element_at(by_rank, F.shiftright(F.col("_last"), SEQ_SHIFT)),
           "frame_no": F.col("_last").bitwiseAND(F.lit((1 << SEQ_SHIFT) - 1)),
           **_doc_unpack(F)}
    return last.select([out.get(f.name, F.col(f.name)).alias(f.name) for f in T.schema_of("dcp", "documents")])


# the packed columns of `documents`: value_len (32 bits) | datatype << 32 | state << 40 | a
# null bit per column from bit 42; item_flags << 32 | expiration (both uint32 in captures)
_NULL_BIT = {"value_len": 42, "datatype": 43, "item_flags": 44, "expiration": 45}


def _doc_pack(F):
    """The two packed longs of a change (F: pyspark.sql.functions)."""
    def bits(name):
        return F.coalesce(F.col(name).cast("long"), F.lit(0).cast("long"))
    state = F.lit(3).cast("long")   # (no other op reaches here; 3 would read back as null)
    for i, op in enumerate(dcp_rules.DOC_STATES):   # op -> state, coded by position
        state = F.when(F.col("op") == op, F.lit(i).cast("long")).otherwise(state)
    state = F.when(F.col("op") == "commit", F.lit(0).cast("long")).otherwise(state)   # a commit is a mutation
    small = bits("value_len").bitwiseOR(F.shiftleft(bits("datatype"), 32)).bitwiseOR(F.shiftleft(state, 40))
    for name, bit in _NULL_BIT.items():
        small = small.bitwiseOR(F.when(F.col(name).isNull(), F.lit(1 << bit).cast("long")).otherwise(F.lit(0).cast("long")))
    return small, F.shiftleft(bits("item_flags"), 32).bitwiseOR(bits("expiration"))


def _doc_unpack(F) -> dict:
    """The columns of `documents` from the packed longs (`_small`, `_flags_exp`)."""
    small, fe = F.col("_small"), F.col("_flags_exp")
    low32 = F.lit(0xFFFFFFFF).cast("long")

    def unless_null(name, value):
        return F.when(F.shiftright(small, _NULL_BIT[name]).bitwiseAND(F.lit(1)) == 0, value)
    states = F.lit(None).cast("string")
    for i, op in enumerate(dcp_rules.DOC_STATES):
        states = F.when(F.shiftright(small, 40).bitwiseAND(F.lit(3)) == i, F.lit(dcp_rules.DOC_STATES[op])).otherwise(states)
    return {"value_len": unless_null("value_len", small.bitwiseAND(low32)),
            "datatype": unless_null("datatype", F.shiftright(small, 32).bitwiseAND(F.lit(0xFF)).cast("smallint")),
            "item_flags": unless_null("item_flags", F.shiftrightunsigned(fe, 32)),
            "expiration": unless_null("expiration", fe.bitwiseAND(low32)),
            "state": states}
