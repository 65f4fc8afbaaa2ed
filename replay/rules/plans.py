"""The DCP tables of REPLAY.md that are relational plans, defined once as SQL and run by both
SQL engines: DuckDB in-process (replay/local/duck.py) and Spark (replay/spark/engine.py).

Each builder returns one SQL text for a `Dialect` (DUCKDB or SPARK): the text is the same
but for the few spellings the two dialects do not share (a right shift, a last value
ignoring nulls, a struct, exploding a list with positions, a string literal), which the
dialect supplies. The frames a plan reads are `source` (a view name, or Spark's `{vb}`
DataFrame argument): the vbucket frames (`in`, with a vbucket, decoded, an op of
dcp_rules.VB_OPS; the `--as-of` cut already applied) with the capture columns, `ts` as
bigint nanoseconds, `_cas_bits` (cas as a 64-bit integer of the same bits: a long in Spark,
UBIGINT in DuckDB; a plan outputs it as `cas`), `_rank` (the capture's rank in frame order)
and `_seq` (`_rank << SEQ_SHIFT | frame_no`, the frame order).

The rules (the same as DcpState's, replay/rules/dcp_vbuckets.py): a change (mutation, deletion,
expiration, commit) is undone when a later ROLLBACK answer of its vbucket rolls back below
its by_seqno (a null by_seqno counts as -1); a commit takes the columns of the last prepare
of its document before it that was not undone (replay/rules/dcp_sync.py); a dropped
collection's documents are gone; each document keeps its last change not undone."""

from __future__ import annotations

from dataclasses import dataclass

from dcptool.protocol.dcp.wire.constants import Status
from dcptool.replay.rules import bodies, dcp_sync
from dcptool.replay.rules.table_types import BODY_COLUMNS, PLAN_COLUMNS

SEQ_SHIFT = 44     # _seq = capture rank << SEQ_SHIFT | frame_no
COLLECTION_DROP = 1      # system_event_id of a collection drop (dcp_rules.COLLECTION_DROP)
DOC_STATES = ("live", "deleted", "expired")   # coded by position in `_small`
# the packed small columns of `documents`: value_len (32 bits) | datatype << 32 | state << 40 |
# a null bit per column from bit 42 (one aggregate instead of four: Spark's hash aggregate and
# DuckDB's both do less per change)
NULL_BIT = {"value_len": 42, "datatype": 43}


@dataclass(frozen=True)
class Dialect:
    name: str

    @property
    def pick_by_join(self) -> bool:
        """Whether `documents` finds each document's last change as max(_seq) per document
        joined back to the changes (DuckDB: measured 1M frames 0.46 s against 0.71 s for one
        arg_max of a struct, 10M 1.4 s against 2.9 s, and less memory), rather than one
        aggregate carrying every column (Spark: `last_by`)."""
        return self.name == "duckdb"

    def inline(self, name: str, body: str) -> str:
        """A CTE read twice and computed where it is read (DuckDB would otherwise materialize
        it: every change in memory at once); Spark inlines CTEs by itself."""
        return f"{name} AS NOT MATERIALIZED ({body})" if self.name == "duckdb" else f"{name} AS ({body})"

    def shr(self, x: str, n: int) -> str:
        return f"shiftright({x}, {n})" if self.name == "spark" else f"(({x}) >> {n})"

    def max_by(self, x: str, y: str) -> str:
        """x of the row with the largest y, null or not (DuckDB's max_by skips a null x)."""
        return f"max_by({x}, {y})" if self.name == "spark" else f"arg_max_null({x}, {y})"

    def last_by(self, values: dict[str, str], order: str) -> tuple[str, dict[str, str]]:
        """Aggregates taking `values` (name -> expression) of the row with the largest
        `order`, as (the select list, name -> the expression reading each afterwards). Spark:
        a max_by each (a struct would make its hash aggregate sort every row); DuckDB: one
        arg_max of a struct (measured 1M frames: 1.3 s against 1.9 s for a max_by each)."""
        if self.name == "spark":
            return (", ".join((f"max({x})" if x == order else f"max_by({x}, {order})") + f" AS {name}"
                              for name, x in values.items()),
                    {name: name for name in values})
        return (f"arg_max_null({self.struct(**values)}, {order}) AS _r",
                {name: f"_r.{name}" for name in values})

    def anti_join(self) -> str:
        return "LEFT ANTI JOIN" if self.name == "spark" else "ANTI JOIN"

    def last_ignore_nulls(self, x: str) -> str:
        return f"last({x}, true)" if self.name == "spark" else f"last({x} IGNORE NULLS)"

    def struct(self, **fields: str) -> str:
        if self.name == "spark":
            return "named_struct(" + ", ".join(f"'{k}', {v}" for k, v in fields.items()) + ")"
        return "struct_pack(" + ", ".join(f"{k} := {v}" for k, v in fields.items()) + ")"

    def string(self, text: str) -> str:
        if self.name == "spark":
            return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return "'" + text.replace("'", "''") + "'"

    def tail(self, x: str, n: str) -> str:
        """The last `n` bytes of the binary `x` (n at most its length)."""
        if self.name == "spark":
            return f"substring({x}, CAST(octet_length({x}) - ({n}) + 1 AS INT))"
        return f"array_slice({x}, octet_length({x}) - ({n}) + 1, octet_length({x}))"

    def utf8(self, x: str) -> str:
        """The binary `x` as text, null when it is not UTF-8."""
        if self.name == "spark":
            return f"try_validate_utf8(CAST({x} AS STRING))"
        return f"try(decode({x}))"

    def exploded(self, table: str, keys: str, lst: str) -> str:
        """FROM text: each row of `table` once per element of its list `lst`, as `_pos`
        (0-based) and `_e`, with its `keys` columns."""
        if self.name == "spark":
            return f"(SELECT {keys}, _pos, _e FROM {table} LATERAL VIEW posexplode({lst}) AS _pos, _e)"
        return (f"(SELECT {keys}, _i - 1 AS _pos, {lst}[_i] AS _e FROM "
                f"(SELECT *, unnest(generate_series(1, len({lst}))) AS _i FROM {table}))")


DUCKDB = Dialect("duckdb")
SPARK = Dialect("spark")


# the frames that carry a value (a commit's is its prepare's)
BODY_OPS = ("mutation", "deletion", "expiration", "prepare")

# the tables defined here, in the order they are usually asked for
PLAN_TABLES = ("documents", "undone", "rollbacks", "failover", "history")


@dataclass(frozen=True)
class PlanFacts:
    """What a plan needs to know of the captures: their ranks in frame order, whether any
    ROLLBACK answer may be there (Parquet statistics), and the ops they may hold (None:
    unknown); a plan leaves out a join whose side can only be empty."""
    ranks: dict
    rollbacks: bool = True
    ops: frozenset | None = None
    coded: bool = True    # a change may carry Snappy or xattrs: bodies call bodies.FUNCTION

    @classmethod
    def of(cls, files: list, ops, coded: bool = True) -> "PlanFacts":
        """Whether a ROLLBACK answer may be there comes from the Parquet statistics when they
        tell (no pyarrow loaded: the DuckDB-written `-o` path), else the column is read."""
        from dcptool.replay.store import discovery
        none = discovery.null_by_statistics(files, "rollback_seqno")
        if none is None:
            from dcptool.replay.store import reader
            rollbacks = reader.may_have_values(files, "rollback_seqno")
        else:
            rollbacks = not none
        return cls(discovery.capture_ranks(files), rollbacks, None if ops is None else frozenset(ops), coded)

    def may_hold(self, op: str) -> bool:
        return self.ops is None or op in self.ops


def table_sql(d: Dialect, name: str, source: str, facts: PlanFacts, bodies: bool = True,
              order: str | None = None) -> str:
    """The SQL of the plan table `name` (PLAN_TABLES) over the vbucket frames `source`;
    `bodies` False: `documents` and `history` without their body columns (and with `_bseq`),
    for a query that does not read them (the document counts of `vbuckets`). `order`: an
    ORDER BY list the rows come out in (DuckDB keeps the order of a sorted subquery through
    the projections above it); `documents` and `history` sort before their bodies are cut
    (with_bodies), so the sort carries one blob a row, not the body columns."""
    if name == "documents":
        commits, drops = facts.may_hold("commit"), facts.may_hold("system_event")
        if not bodies:
            return _sorted(documents_sql(d, source, facts.ranks, facts.rollbacks, commits, drops), order)
        carried = not (facts.rollbacks or commits or drops)
        return with_bodies(d, documents_sql(d, source, facts.ranks, facts.rollbacks, commits, drops, carried),
                           source, name, facts.coded, carried, order)
    if name == "history":
        if not bodies:
            return _sorted(history_sql(d, source, facts.ranks), order)
        return with_bodies(d, history_sql(d, source, facts.ranks), source, name, facts.coded, order=order)
    if name == "undone":
        return _sorted(undone_sql(d, source, facts.ranks, facts.rollbacks), order)
    if name == "rollbacks":
        return _sorted(rollbacks_sql(d, source, facts.ranks, facts.rollbacks), order)
    if name == "failover":
        return _sorted(failover_sql(d, source), order)
    raise KeyError(name)


def _sorted(sql: str, order: str | None) -> str:
    return sql if order is None else f"SELECT * FROM ({sql}) _o ORDER BY {order}"


def capture_of(d: Dialect, seq: str, ranks: dict[str, int]) -> str:
    """The capture_id of the frame whose `_seq` is `seq`."""
    return rank_to_capture(d, d.shr(seq, SEQ_SHIFT), ranks)


def rank_to_capture(d: Dialect, rank: str, ranks: dict[str, int]) -> str:
    if not ranks:
        return "CAST(NULL AS STRING)" if d.name == "spark" else "CAST(NULL AS VARCHAR)"
    whens = " ".join(f"WHEN {r} THEN {d.string(cid)}" for cid, r in ranks.items())
    return f"CASE {rank} {whens} END"


def frame_of(seq: str) -> str:
    return f"({seq} & {(1 << SEQ_SHIFT) - 1})"


def rollback_answers(source: str) -> str:
    return (f"SELECT * FROM {source} WHERE op = 'stream_req' AND status = {int(Status.ROLLBACK)} "
            "AND rollback_seqno IS NOT NULL")


def _alive(d: Dialect, source: str, where: str) -> str:
    """The rows of `source` matching `where` that no later ROLLBACK answer (`_rb`) undid: an
    anti join with the few answers broadcast (Spark's hint; a comment to DuckDB)."""
    return (f"SELECT /*+ BROADCAST(_rb) */ c.* FROM {source} c {d.anti_join()} _rb ON _rb.r_vb = c.vbucket "
            f"AND _rb.r_seq > c._seq AND coalesce(c.by_seqno, -1) > _rb.r_seqno WHERE {where}")


def _not_undone(alias: str) -> str:
    return (f"NOT EXISTS (SELECT 1 FROM _rb WHERE _rb.r_vb = {alias}.vbucket AND _rb.r_seq > {alias}._seq "
            f"AND coalesce({alias}.by_seqno, -1) > _rb.r_seqno)")


def _in(values) -> str:
    return "(" + ", ".join(f"'{v}'" for v in values) + ")"


def documents_sql(d: Dialect, source: str, ranks: dict[str, int], rollbacks: bool = True,
                  commits: bool = True, drops: bool = True, carry_raw: bool = False) -> str:
    """`documents`: each document's last change not undone. DuckDB: max(_seq) per document
    and a semi join back (_documents_by_join); Spark: one hash aggregate of numbers (frame_no
    and the capture come from max(_seq); the small columns travel packed in `_small`). `rollbacks`, `commits`, `drops` False (the Parquet statistics or dictionaries
    show none) leave out a join whose side can only be empty. `carry_raw` (Spark, bodies asked
    for): when the changes are a plain filter of the frames, each document's last change is
    picked by a window carrying `raw` (_documents_by_window) instead."""
    ctes = [f"_rb AS (SELECT vbucket AS r_vb, _seq AS r_seq, rollback_seqno AS r_seqno FROM ({rollback_answers(source)}) _a)"]
    changed = f"c.op IN {_in(dcp_sync.DOC_CHANGE_OPS)}"
    alive = _alive(d, source, changed) if rollbacks else f"SELECT * FROM {source} c WHERE {changed}"
    plain = not (rollbacks or commits or drops)   # the changes are a filter of the frames
    ctes.append(d.inline("_alive", alive) if plain and d.pick_by_join else f"_alive AS ({alive})")
    changes = "_alive"
    bseq = "_bseq" if commits else "_seq"    # the frame whose value is the document's (a prepare's for a commit)
    if commits:
        prep = _alive(d, source, "c.op = 'prepare'") if rollbacks else f"SELECT * FROM {source} c WHERE c.op = 'prepare'"
        cols = dcp_sync.FROM_PREPARE + ("_cas_bits",)
        found = ("SELECT c._seq AS c_seq, " + ", ".join(f"{d.max_by('p.' + c, 'p._seq')} AS c_{c}" for c in cols)
                 + ", max(p._seq) AS c_pseq"
                 + f" FROM _alive c JOIN ({prep}) p ON c.op = 'commit' AND p.vbucket = c.vbucket"
                 " AND p.collection_id IS NOT DISTINCT FROM c.collection_id"
                 " AND p.key IS NOT DISTINCT FROM c.key AND p._seq < c._seq GROUP BY c._seq")
        taken = ", ".join(f"CASE WHEN f.c_seq IS NOT NULL THEN f.c_{c} ELSE a.{c} END AS {c}" for c in cols)
        ctes.append(f"_found AS ({found})")
        ctes.append("_changes AS (SELECT a.vbucket, a.collection_id, a.key, a.op, a.by_seqno, a.ts, a._seq, "
                    "CASE WHEN f.c_seq IS NOT NULL THEN f.c_pseq WHEN a.op = 'commit' THEN NULL ELSE a._seq END AS _bseq, "
                    f"{taken} FROM _alive a LEFT JOIN _found f ON a._seq = f.c_seq)".replace(
                        "SELECT", "SELECT /*+ BROADCAST(f) */", 1))
        changes = "_changes"
    if drops:
        ctes.append(f"_drops AS (SELECT DISTINCT vbucket AS x_vb, collection_id AS x_cid FROM {source} "
                    f"WHERE op = 'system_event' AND system_event_id = {COLLECTION_DROP} AND collection_id IS NOT NULL)")
        ctes.append(f"_kept AS (SELECT /*+ BROADCAST(_drops) */ k.* FROM {changes} k {d.anti_join()} _drops "
                    "ON x_vb = k.vbucket AND x_cid = k.collection_id)")
        changes = "_kept"
    if d.pick_by_join:
        return _documents_by_join(d, ctes, changes, ranks, bseq, plain)
    if plain and carry_raw:
        return _documents_by_window(d, ctes, changes, ranks)
    state = ("CASE op WHEN 'deletion' THEN 1 WHEN 'expiration' THEN 2 ELSE 0 END")
    small = (f"(coalesce(CAST(value_len AS BIGINT), 0) + coalesce(CAST(datatype AS BIGINT), 0) * {1 << 32}"
             f" + ({state}) * {1 << 40}"
             + "".join(f" + CASE WHEN {c} IS NULL THEN {1 << b} ELSE 0 END" for c, b in NULL_BIT.items()) + ")")
    values = {"_last": "_seq", "by_seqno": "by_seqno", "rev_seqno": "rev_seqno", "cas": "_cas_bits",
              "_small": small, "item_flags": "item_flags", "expiration": "expiration", "ts": "ts", "_bseq": bseq}
    aggs, v = d.last_by(values, "_seq")
    agg = f"SELECT vbucket, collection_id, key, {aggs} FROM {changes} GROUP BY vbucket, collection_id, key"
    states = " ".join(f"WHEN {i} THEN '{s}'" for i, s in enumerate(DOC_STATES))

    def unless_null(name: str, value: str) -> str:
        return f"CASE WHEN ({d.shr(v['_small'], NULL_BIT[name])} & 1) = 0 THEN {value} END"
    return ("WITH " + ",\n".join(ctes) + f",\n_last AS ({agg})\n"
            f"SELECT vbucket, collection_id, key, {v['by_seqno']} AS by_seqno, {v['rev_seqno']} AS rev_seqno, "
            f"{v['cas']} AS cas, CASE {d.shr(v['_small'], 40)} & 3 {states} END AS state, "
            f"{unless_null('datatype', d.shr(v['_small'], 32) + ' & 255')} AS datatype, "
            f"{v['item_flags']} AS item_flags, {v['expiration']} AS expiration, "
            f"{unless_null('value_len', v['_small'] + ' & 4294967295')} AS value_len, "
            f"{capture_of(d, v['_last'], ranks)} AS capture_id, {frame_of(v['_last'])} AS frame_no, "
            f"{v['ts']} AS ts, {v['_bseq']} AS _bseq FROM _last")


def _documents_by_join(d: Dialect, ctes: list[str], changes: str, ranks: dict[str, int], bseq: str,
                       plain: bool) -> str:
    """`documents` as each document's max(_seq), its change taken from the changes by a semi
    join (`_seq` is unique): the aggregate carries one number per document. The changes are
    read twice; a plain filter of the frames is read again rather than held (NOT MATERIALIZED),
    a chain with joins is computed once."""
    ctes = ctes + [f"_pick AS (SELECT max(_seq) AS _m FROM {changes} GROUP BY vbucket, collection_id, key)"]
    return ("WITH " + ",\n".join(ctes) + "\n"
            "SELECT vbucket, collection_id, key, by_seqno, rev_seqno, _cas_bits AS cas, CASE op WHEN 'deletion' "
            "THEN 'deleted' WHEN 'expiration' THEN 'expired' ELSE 'live' END AS state, datatype, item_flags, "
            f"expiration, value_len, {capture_of(d, '_seq', ranks)} AS capture_id, {frame_of('_seq')} AS frame_no, "
            f"ts, {bseq} AS _bseq{', raw AS _raw' if plain else ''} FROM {changes} k SEMI JOIN _pick ON k._seq = _pick._m")


def _documents_by_window(d: Dialect, ctes: list[str], changes: str, ranks: dict[str, int]) -> str:
    """`documents` (Spark, the changes a plain filter of the frames) as the change ranked first
    by `_seq` descending per document, with its `raw` as `_raw`: one shuffle of the changes
    carrying their frames, where the aggregate and the join of `raw` back by `_seq` shuffle
    the frames once and the numbers twice (measured 300k documents of 512 bytes, each written
    once: the window 1.5-2x faster cold). Spark limits each partition to its top row before
    the shuffle (its window group limit), so a document changed many times ships one frame."""
    ranked = (f"SELECT *, row_number() OVER (PARTITION BY vbucket, collection_id, key ORDER BY _seq DESC) AS _n "
              f"FROM {changes}")
    return ("WITH " + ",\n".join(ctes + [f"_ranked AS ({ranked})"]) + "\n"
            "SELECT vbucket, collection_id, key, by_seqno, rev_seqno, _cas_bits AS cas, CASE op WHEN 'deletion' "
            "THEN 'deleted' WHEN 'expiration' THEN 'expired' ELSE 'live' END AS state, datatype, item_flags, "
            f"expiration, value_len, {capture_of(d, '_seq', ranks)} AS capture_id, {frame_of('_seq')} AS frame_no, "
            "ts, _seq AS _bseq, raw AS _raw FROM _ranked WHERE _n = 1")


def _undone_ctes(source: str, rollbacks: bool) -> str:
    """_rb (the ROLLBACK answers), _ch (the changes), _undone (each undone change with the
    earliest rollback that undid it, r_*)."""
    rb = (f"SELECT vbucket AS r_vb, _seq AS r_seq, rollback_seqno AS r_seqno, _rank AS r_rank, "
          f"frame_no AS r_frame_no, ts AS r_ts FROM ({rollback_answers(source)}) _a"
          + ("" if rollbacks else " WHERE false"))
    ch = (f"SELECT vbucket, collection_id, key, by_seqno, op, _rank, frame_no, ts, _seq FROM {source} "
          f"WHERE op IN {_in(dcp_sync.DOC_CHANGE_OPS)}")
    pairs = ("SELECT c.*, _rb.*, row_number() OVER (PARTITION BY c._seq ORDER BY _rb.r_seq) AS _n "
             "FROM _ch c JOIN _rb ON _rb.r_vb = c.vbucket AND _rb.r_seq > c._seq AND coalesce(c.by_seqno, -1) > _rb.r_seqno")
    return (f"WITH _rb AS ({rb}),\n_ch AS ({ch}),\n_pairs AS ({pairs}),\n"
            "_undone AS (SELECT * FROM _pairs WHERE _n = 1)")


def undone_sql(d: Dialect, source: str, ranks: dict[str, int], rollbacks: bool = True) -> str:
    """`undone`: each undone change with the earliest rollback that undid it; `restored` when
    the document's current change (its last one not undone) came after that rollback."""
    current = ("SELECT vbucket AS d_vb, collection_id AS d_cid, key AS d_key, max(_seq) AS d_seq, "
               f"{d.max_by('by_seqno', '_seq')} AS d_seqno FROM _ch c WHERE {_not_undone('c')} "
               "GROUP BY vbucket, collection_id, key")
    restored = "coalesce(d_seq > r_seq, false)"
    return (_undone_ctes(source, rollbacks) + f",\n_cur AS ({current})\n"
            f"SELECT vbucket, {rank_to_capture(d, 'r_rank', ranks)} AS capture_id, r_frame_no AS frame_no, "
            "r_ts AS ts, r_seqno AS rollback_seqno, collection_id, key, by_seqno, op, "
            f"{rank_to_capture(d, '_rank', ranks)} AS change_capture_id, frame_no AS change_frame_no, "
            f"ts AS change_ts, {restored} AS restored, CASE WHEN {restored} THEN d_seqno END AS restored_seqno "
            "FROM _undone u LEFT JOIN _cur ON u.vbucket = d_vb AND u.collection_id IS NOT DISTINCT FROM d_cid "
            "AND u.key IS NOT DISTINCT FROM d_key")


def rollbacks_sql(d: Dialect, source: str, ranks: dict[str, int], rollbacks: bool = True) -> str:
    """`rollbacks`: each ROLLBACK answer with the number of changes it undid (those of
    `undone` whose earliest rollback it is)."""
    return (_undone_ctes(source, rollbacks) + ",\n"
            "_counts AS (SELECT r_seq AS c_seq, count(*) AS c_undone FROM _undone GROUP BY r_seq)\n"
            f"SELECT r_vb AS vbucket, {rank_to_capture(d, 'r_rank', ranks)} AS capture_id, r_frame_no AS frame_no, "
            "r_ts AS ts, r_seqno AS rollback_seqno, CAST(coalesce(c_undone, 0) AS BIGINT) AS undone "
            "FROM _rb LEFT JOIN _counts ON r_seq = c_seq")


def failover_sql(d: Dialect, source: str) -> str:
    """`failover`: the failover log of each vbucket's last stream-request success, one row per
    entry, position 0 = the newest entry as on the wire."""
    last = (f"SELECT vbucket, {d.max_by('failover_log', '_seq')} AS _log FROM {source} WHERE op = 'stream_req' "
            f"AND status = {int(Status.SUCCESS)} AND failover_log IS NOT NULL GROUP BY vbucket")
    return (f"WITH _last AS ({last})\n"
            "SELECT vbucket, CAST(_pos AS INT) AS position, _e.vbucket_uuid AS vbucket_uuid, _e.seqno AS seqno "
            f"FROM {d.exploded('_last', 'vbucket', '_log')} _x")


def history_sql(d: Dialect, source: str, ranks: dict[str, int]) -> str:
    """`history` (replay/rules/history.py): every change not undone, the last received of each
    (vbucket, collection_id, key, by_seqno). `_snap`: the flags of the last marker of the
    stream (vbucket, stream id) before the row (-1: a stream end, a stream-request answer or
    an OSO marker came after it); `_p`: the columns of the last prepare of the document
    before it (a commit takes them)."""
    closers = "('stream_end', 'stream_req', 'oso_snapshot')"
    snap = d.last_ignore_nulls("CASE WHEN op = 'snapshot_marker' THEN coalesce(CAST(snap_flags AS BIGINT), -1) "
                               f"WHEN op IN {closers} THEN -1 END")
    cols: tuple[str, ...] = dcp_sync.FROM_PREPARE[:2] + ("_cas_bits",) + dcp_sync.FROM_PREPARE[2:]
    cols = tuple(c for c in cols if c != "cas")
    prep = d.last_ignore_nulls("CASE WHEN op = 'prepare' THEN " + d.struct(**{c: c for c in cols}, _pseq="_seq")
                               + " END")
    taken = ", ".join(f"CASE WHEN op = 'commit' AND _p IS NOT NULL THEN _p.{c} ELSE {c} END AS {c}" for c in cols)
    ops = _in(("mutation", "deletion", "expiration", "commit", "prepare", "snapshot_marker", "stream_end",
               "stream_req", "oso_snapshot"))
    return f"""WITH _f AS (SELECT * FROM {source} WHERE op IN {ops}),
_rb AS (SELECT vbucket AS r_vb, _seq AS r_seq, rollback_seqno AS r_seqno FROM ({rollback_answers('_f')}) _a),
_snap AS (SELECT *, {snap} OVER (PARTITION BY vbucket, stream_id ORDER BY _seq
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS _snap FROM _f),
_alive AS (SELECT * FROM _snap s WHERE op IN ('mutation', 'deletion', 'expiration', 'commit', 'prepare')
           AND {_not_undone('s')}),
_res AS (SELECT *, {prep} OVER (PARTITION BY vbucket, collection_id, key ORDER BY _seq
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS _p FROM _alive),
_chg AS (SELECT vbucket, collection_id, key, by_seqno, op, {taken},
         CASE WHEN _snap >= 0 THEN _snap END AS snap_flags, _rank, frame_no, ts,
         CASE WHEN op = 'commit' THEN _p._pseq ELSE _seq END AS _bseq,
         row_number() OVER (PARTITION BY vbucket, collection_id, key, by_seqno ORDER BY _seq DESC) AS _n
         FROM _res WHERE op <> 'prepare')
SELECT vbucket, collection_id, key, by_seqno, op,
       CASE op WHEN 'deletion' THEN 'deleted' WHEN 'expiration' THEN 'expired' ELSE 'live' END AS state,
       rev_seqno, _cas_bits AS cas, datatype, item_flags, expiration, value_len, snap_flags,
       {rank_to_capture(d, '_rank', ranks)} AS capture_id, frame_no, ts, _bseq
FROM _chg WHERE _n = 1"""


def with_raw(sql: str, source: str) -> str:
    """The rows of `sql` (a plan with `_bseq`) with `_raw`: the `raw` of the frame whose value
    is the row's, joined in by frame order (null when that frame is not in `source`)."""
    return (f"SELECT _b.*, _r.raw AS _raw FROM ({sql}) _b LEFT JOIN (SELECT _seq AS _r_seq, raw FROM {source} "
            f"WHERE op IN {_in(BODY_OPS)}) _r ON _r._r_seq = _b._bseq")


def value_as_sent(d: Dialect, raw: str, value_len: str) -> str:
    """The value as sent of the frame `raw`: its last `value_len` bytes (a DCP frame's body
    ends with its value); null when either is null or the length does not fit after a header."""
    return (f"CASE WHEN {raw} IS NOT NULL AND {value_len} IS NOT NULL AND {value_len} <= octet_length({raw}) - 24 "
            f"THEN {d.tail(raw, value_len)} END")


def with_bodies(d: Dialect, sql: str, source: str, name: str, coded: bool = True, carried: bool = False,
                order: str | None = None) -> str:
    """The plan `sql` (the columns of `name` but the body ones, and `_bseq`: the frame whose
    value is the row's) with its bodies (replay/rules/bodies.py): `raw` of that frame joined
    in after the plan chose its rows, the value as sent cut off its end (its last `value_len`
    bytes), `bodies.FUNCTION` over the rows whose datatype says Snappy or xattrs (`coded`
    False: the facts show none, the function is left out), `value_json` when the datatype
    says JSON and the value is UTF-8. `carried`: `sql` has `_raw` already (DuckDB's
    `documents` over a plain filter of the frames: `raw` read by the scan that picks the rows,
    no join: one hash join of every change frame less). `order`: the rows sorted by it after
    `raw` is joined and before the cut (table_sql), so a sort carries `raw` alone (measured
    300k documents of 512-byte JSON: the sort's payload 1.9x smaller than value and
    value_json, peak RSS lower)."""
    keep = ", ".join(c for c, _ in PLAN_COLUMNS[name] if c not in BODY_COLUMNS)
    dt = "coalesce(CAST(datatype AS INT), 0)"
    joined = _sorted(sql if carried else with_raw(sql, source), order)
    sent = f"SELECT {keep}, {value_as_sent(d, '_raw', 'value_len')} AS _v FROM ({joined}) _j"
    if coded:
        when = f"({dt} & {bodies.CODED}) <> 0"
        called = (f"SELECT {keep}, _v, CASE WHEN {when} THEN {bodies.FUNCTION}(CASE WHEN {when} THEN _v END, "
                  f"{dt}) END AS _x FROM ({sent}) _c")
        stored = f"SELECT {keep}, CASE WHEN {when} THEN _x.value ELSE _v END AS value, _x.xattrs AS xattrs FROM ({called}) _s"
    else:
        text = "STRING" if d.name == "spark" else "VARCHAR"
        stored = f"SELECT {keep}, _v AS value, CAST(NULL AS {text}) AS xattrs FROM ({sent}) _c"
    return (f"SELECT {keep}, value, xattrs, CASE WHEN ({dt} & 1) = 1 THEN {d.utf8('value')} END AS value_json "
            f"FROM ({stored}) _u")


def as_of_sql(as_of) -> str:
    """The condition that keeps the frames `as_of` (replay/rules/as_of.py) keeps, null-safe as
    AsOf.mask (`ts` as bigint nanoseconds); the same text in both dialects."""
    cond = ["true"]
    if as_of.ts_ns is not None:
        cond.append(f"coalesce(ts <= {int(as_of.ts_ns)}, false)")
    lowest = -(1 << 63)
    lo = f"CAST({lowest + 1} AS BIGINT) - 1"
    start = f"CASE WHEN coalesce(op = 'snapshot_marker', false) THEN coalesce(snap_start, {lo}) ELSE {lo} END"
    for vb, seqno in as_of.seqnos:
        cond.append(f"NOT (coalesce(CAST(vbucket AS BIGINT), -1) = {int(vb)} AND "
                    f"(coalesce(by_seqno, {lo}) > {int(seqno)} OR {start} > {int(seqno)}))")
    return " AND ".join(cond)
