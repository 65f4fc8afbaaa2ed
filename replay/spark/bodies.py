"""Document bodies on Spark (REPLAY.md "Bodies"): replay/rules/bodies.py `split` as the
session's Python UDF `dcp_body(value, datatype)`, which the plans of replay/rules/plans.py
call for the rows whose datatype says Snappy or xattrs. Registered only when the Parquet
statistics of `datatype` leave that possible (bodies.may_be_coded); otherwise the plans cut
bodies in SQL alone and no Python worker starts. An Arrow-optimised UDF: rows reach the
Python worker in Arrow batches (Spark extracts a Python UDF out of its CASE, so every row of
the plan reaches it; the others with a null value, returned at once)."""

from __future__ import annotations

from typing import Any

from dcptool.replay.rules import bodies


def prepare(spark: Any, files: list[Any], F: Any) -> bool:  # noqa: N803 - F: pyspark.sql.functions
    """Registers `dcp_body` on `spark` when a change of `files` may carry Snappy or xattrs,
    and says whether it did (plans.PlanFacts.coded). `F` is pyspark.sql.functions, passed in
    (only engine.py imports pyspark)."""
    if not bodies.may_be_coded(files):
        return False
    spark.udf.register(bodies.FUNCTION, F.udf(_split, "struct<value:binary,xattrs:string>", useArrow=True))
    return True


def _split(value: bytes | None, datatype: int | None) -> dict[str, object]:
    return bodies.split_struct(value, datatype)
