"""uint64 `cas` in Spark, for replay/spark/engine.py: Spark has no unsigned types, so a uint64
is read as decimal(20,0), and the plans of replay/rules/plans.py carry it as the long of the
same bits. The functions take pyspark.sql.functions as `F`: only engine.py imports pyspark."""

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
