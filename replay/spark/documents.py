"""uint64 `cas` in Spark, for replay/spark/engine.py: Spark has no unsigned types, so a uint64
is read as decimal(20,0), and the plans of replay/rules/plans.py carry it as the long of the
same bits. The functions take pyspark.sql.functions as `F`: only engine.py imports pyspark;
and `vbuckets_with_counts`, engine.py's `vbuckets` with its document counts."""

from __future__ import annotations

import decimal


def cas_decimal(F, bits):  # noqa: N803 - F: pyspark.sql.functions, passed in (only engine.py imports pyspark)
    """A uint64 held as the long of its bits, as the decimal(20,0) Spark reads uint64 as."""
    wide = bits.cast("decimal(21,0)")
    return F.when(bits < 0, wide + F.lit(decimal.Decimal(2**64)).cast("decimal(21,0)")).otherwise(wide) \
        .cast("decimal(20,0)")


def cas_bits(F, dec):  # noqa: N803 - F: pyspark.sql.functions, as above
    """The long of the same bits as a uint64 read as decimal(20,0) (cas_decimal's inverse)."""
    return F.when(dec >= F.lit(decimal.Decimal(2**63)), dec - F.lit(decimal.Decimal(2**64))).otherwise(dec).cast("long")


def vbuckets_with_counts(rep, F):  # noqa: N803 - rep: engine.SparkReplay; F as above
    """`vbuckets` of the grouped rules with its live / deleted / expired counts from the
    `documents` plan without its bodies (a GROUP BY vbucket, as the in-process engine counts
    them). Moved here from engine.py (which imports this module) to keep it under 600 lines."""
    from dcptool.replay.rules import dcp_vbuckets as dcp_rules
    from dcptool.replay.rules import tables as T
    names = [f.name for f in T.schema_of("dcp", "vbuckets")]
    i = rep.result_names.index("vbuckets")
    vb = rep.packed_df.filter(F.col("_t") == i).select([F.col(f"vbuckets__{n}").alias(n) for n in names])
    states = list(dcp_rules.DOC_STATES.values())
    counts = rep.dataframe("_states").groupBy(F.col("vbucket").alias("_c_vb")).agg(
        *[F.count(F.when(F.col("state") == s, 1)).alias("_c_" + s) for s in states])
    joined = vb.join(counts, F.col("vbucket") == F.col("_c_vb"), "left")
    return joined.select([F.coalesce(F.col("_c_" + n), F.lit(0)).cast("long").alias(n) if n in states else F.col(n)
                          for n in names])
