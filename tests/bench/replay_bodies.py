"""What bodies cost in `replay --table documents` (issue 37.4), for bench_replay.py: on one
capture, each a fresh child process, timed and with its own peak RSS (replay_rss.child_peak):

- `documents` with bodies (`dcptool replay CAP --table documents -o OUT`, DuckDB writes the
  file) against the same replay with the body step left out (plans.with_bodies replaced, in
  that child only, by typed nulls: today's `documents` before bodies). Goal <= 1.3x.
- the bodies' own work alone (DUCK_BODIES_ALONE: the chosen frames' `raw` read, the value
  cut, both body columns written; no plan), as a process: (without + alone) / without is the
  ratio when that work is simply added to the plan's.
- that replay against a DuckDB query by hand returning the same rows and bodies (last change
  by frame order, the value cut off the end of `raw`, `value_json` by `decode`), as a process.
  Goal <= 1.2x, time and peak RSS.
- `replay --spark` (embedded, cold: a fresh process each) against a hand-written Spark SQL query
  over the same Parquet on the same kind of session (dcptool's make_session settings), writing
  the same rows. Goal <= 1.5x.
The results are checked equal (rows, and the bodies column for column)."""

from __future__ import annotations

import os
import tempfile

from tests.bench.replay_rss import child_peak, parquet_of

# the hand query: each document's last change by frame order (the captures benchmarked hold no
# rollback, commit or collection drop), the body cut from `raw` as REPLAY.md "Bodies" says
DUCK_BODIES = """
COPY (
  SELECT vbucket, collection_id, key, _r.by_seqno, _r.rev_seqno, _r.cas,
         CASE _r.op WHEN 'mutation' THEN 'live' WHEN 'deletion' THEN 'deleted' ELSE 'expired' END AS state,
         _r.datatype, _r.item_flags, _r.expiration, _r.value_len, _r.frame_no,
         CASE WHEN _r.value_len <= octet_length(_r.raw) - 24
              THEN array_slice(_r.raw, octet_length(_r.raw) - _r.value_len + 1, octet_length(_r.raw)) END AS value,
         CASE WHEN (_r.datatype & 1) = 1 AND _r.value_len <= octet_length(_r.raw) - 24
              THEN try(decode(array_slice(_r.raw, octet_length(_r.raw) - _r.value_len + 1, octet_length(_r.raw)))) END
              AS value_json
  FROM (SELECT vbucket, collection_id, key,
               arg_max({{'by_seqno': by_seqno, 'rev_seqno': rev_seqno, 'cas': cas, 'op': op, 'datatype': datatype,
                        'item_flags': item_flags, 'expiration': expiration, 'value_len': value_len,
                        'frame_no': frame_no, 'raw': raw}}, frame_no) AS _r
        FROM read_parquet({src})
        WHERE direction = 'in' AND vbucket IS NOT NULL AND decode_error IS NULL
          AND op IN ('mutation', 'deletion', 'expiration')
        GROUP BY vbucket, collection_id, key)
  ORDER BY vbucket, collection_id, key
) TO '{dst}' (FORMAT parquet, COMPRESSION zstd)
"""

# the bodies' own work, alone: the frames the replay chose (its `frame_no`s, read from the
# replay's output without bodies) read with their `raw`, the value cut, both body columns written
# (zstd level 1, as the replay writes); no plan, no sort. Bodies cut from the frames cost about
# this on top of the plan: (without + this) / without is what the with/without ratio comes to
# when the bodies' work is simply added (measured: the replay with bodies does a little better,
# its sort and scan shared).
DUCK_BODIES_ALONE = """
COPY (
  SELECT f.frame_no,
         array_slice(f.raw, octet_length(f.raw) - CAST(f.value_len AS BIGINT) + 1, octet_length(f.raw)) AS value,
         CASE WHEN (f.datatype & 1) = 1
              THEN try(decode(array_slice(f.raw, octet_length(f.raw) - CAST(f.value_len AS BIGINT) + 1,
                                          octet_length(f.raw)))) END AS value_json
  FROM read_parquet({src}) f SEMI JOIN read_parquet('{chosen}') d ON f.frame_no = d.frame_no
  WHERE f.direction = 'in' AND f.op IN ('mutation', 'deletion', 'expiration')
) TO '{dst}' (FORMAT parquet, COMPRESSION zstd, COMPRESSION_LEVEL 1)
"""

SPARK_BODIES = """
SELECT vbucket, collection_id, key, by_seqno, rev_seqno, cas,
       CASE op WHEN 'mutation' THEN 'live' WHEN 'deletion' THEN 'deleted' ELSE 'expired' END AS state,
       datatype, item_flags, expiration, value_len, frame_no,
       CASE WHEN value_len <= octet_length(raw) - 24
            THEN substring(raw, CAST(octet_length(raw) - value_len + 1 AS INT)) END AS value,
       CASE WHEN (datatype & 1) = 1 AND value_len <= octet_length(raw) - 24
            THEN try_validate_utf8(CAST(substring(raw, CAST(octet_length(raw) - value_len + 1 AS INT)) AS STRING))
            END AS value_json
FROM (SELECT *, row_number() OVER (PARTITION BY vbucket, collection_id, key ORDER BY frame_no DESC) AS _n
      FROM frames WHERE direction = 'in' AND vbucket IS NOT NULL AND decode_error IS NULL
        AND op IN ('mutation', 'deletion', 'expiration')) _t
WHERE _n = 1
"""

# the child without the body step: plans.with_bodies gives typed nulls (today's documents)
_NO_BODIES = """
import sys
from dcptool.replay.rules import plans
from dcptool.replay.rules.table_types import BODY_COLUMNS, PLAN_COLUMNS
def _none(d, sql, source, name, coded=True, carried=False, order=None):
    keep = ", ".join(c for c, _ in PLAN_COLUMNS[name] if c not in BODY_COLUMNS)
    return (f"SELECT {keep}, CAST(NULL AS BLOB) AS value, CAST(NULL AS VARCHAR) AS xattrs, "
            f"CAST(NULL AS VARCHAR) AS value_json FROM ({sql}) _b" + (f" ORDER BY {order}" if order else ""))
plans.with_bodies = _none
from dcptool.cli import main
main(sys.argv[1:])
"""

_SPARK_HAND = """
import sys, time
from dcptool.replay.spark.engine import make_session
src, dst, sql = sys.argv[1], sys.argv[2], sys.argv[3]
spark = make_session("local[*]")
import glob
spark.read.parquet(*sorted(glob.glob(src + "/*.parquet"))).createOrReplaceTempView("frames")
spark.sql(sql).coalesce(1).write.mode("overwrite").option("compression", "zstd").parquet(dst)
"""


def _src(cap: str) -> str:
    files = parquet_of(cap)
    return "'" + files[0] + "'" if len(files) == 1 else "'" + os.path.join(cap, "*.parquet") + "'"


def measure(cap: str, spark: bool, threads: int = 2) -> dict:
    """The runs above on capture directory `cap`: seconds and peak MiB of each, rows checked."""
    import pyarrow.parquet as pq
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="dcptool-bodies-") as tmp:
        with_b, without = os.path.join(tmp, "with"), os.path.join(tmp, "without")
        out["with_s"], out["with_mib"] = child_peak(["-m", "dcptool.cli", "replay", cap, "--table", "documents",
                                                     "-o", with_b])
        out["without_s"], out["without_mib"] = child_peak(["-c", _NO_BODIES, "replay", cap, "--table", "documents",
                                                           "-o", without])
        dst = os.path.join(tmp, "duck.parquet")
        script = (f"import duckdb; c = duckdb.connect(); c.execute('SET threads TO {threads}'); "
                  f"c.execute('SET enable_progress_bar = false'); "
                  f"c.execute({DUCK_BODIES.format(src=_src(cap), dst=dst)!r})")
        out["duck_s"], out["duck_mib"] = child_peak(["-c", script])
        alone_sql = DUCK_BODIES_ALONE.format(src=_src(cap), chosen=os.path.join(without, "documents.parquet"),
                                             dst=os.path.join(tmp, "alone.parquet"))
        alone = (f"import duckdb; c = duckdb.connect(); c.execute('SET threads TO {threads}'); "
                 f"c.execute('SET enable_progress_bar = false'); c.execute({alone_sql!r})")
        out["alone_s"], out["alone_mib"] = child_peak(["-c", alone])
        mine = pq.read_table(os.path.join(with_b, "documents.parquet"))
        hand = pq.read_table(dst)
        out["documents"] = mine.num_rows
        assert hand.num_rows == mine.num_rows, (hand.num_rows, mine.num_rows)
        for c in ("key", "by_seqno", "frame_no", "value", "value_json"):
            assert hand.column(c).to_pylist() == mine.column(c).to_pylist(), c
        out["bodies_mib"] = sum(len(v) for v in mine.column("value").to_pylist() if v) / 2**20
        if spark:
            so, sh = os.path.join(tmp, "spark"), os.path.join(tmp, "spark-hand")
            out["spark_s"], out["spark_mib"] = child_peak(["-m", "dcptool.cli", "replay", cap, "--master", "local[*]",
                                                           "--table", "documents", "-o", so])
            out["spark_hand_s"], out["spark_hand_mib"] = child_peak(["-c", _SPARK_HAND, cap, sh, SPARK_BODIES])
            theirs = pq.read_table(sh).sort_by([("vbucket", "ascending"), ("collection_id", "ascending"),
                                                ("key", "ascending")])
            spark_mine = pq.read_table(os.path.join(so, "documents.parquet"))
            assert theirs.num_rows == spark_mine.num_rows == mine.num_rows
            for c in ("key", "frame_no", "value", "value_json"):
                assert theirs.column(c).to_pylist() == spark_mine.column(c).to_pylist(), c
    return out


def report(name: str, m: dict) -> str:
    line = (f"  {name}: {m['documents']:,} documents, {m['bodies_mib']:.0f} MiB of bodies | with bodies "
            f"{m['with_s']:.2f}s {m['with_mib']:.0f} MiB, without {m['without_s']:.2f}s {m['without_mib']:.0f} MiB "
            f"({m['with_s'] / m['without_s']:.2f}x, goal <= 1.3x; the bodies' own work alone {m['alone_s']:.2f}s: "
            f"without + alone = {(m['without_s'] + m['alone_s']) / m['without_s']:.2f}x) | DuckDB by hand with the same bodies "
            f"{m['duck_s']:.2f}s {m['duck_mib']:.0f} MiB: time {m['with_s'] / m['duck_s']:.2f}x, "
            f"RSS {m['with_mib'] / m['duck_mib']:.2f}x (goal <= 1.2x)")
    if "spark_s" in m:
        line += (f" | spark cold {m['spark_s']:.2f}s against Spark SQL by hand {m['spark_hand_s']:.2f}s "
                 f"({m['spark_s'] / m['spark_hand_s']:.2f}x, goal <= 1.5x)")
    return line
