"""The `dcptool replay --spark` commands of the suite that are about a fresh process with an
embedded session, run ONCE for the whole test run in one fresh process (cli_batch.py) by the
session fixture `fresh_spark_cli` (tests/conftest.py): one Python start and one JVM start
instead of three. Each test keeps its own assertions on its command's result; the commands
are here because they share the process:

- "sql-safety" (tests/hostile/test_sql_safety.py) runs FIRST, so it is the one that starts
  the JVM: with -v, in a process started with DCPTOOL_PASSWORD and SOME_SECRET in its
  environment, in an empty working directory (`cwd`, which must still be empty after the
  whole batch);
- "local1" (tests/replay/test_replay_spark.py): local[1], 3 shuffle partitions, six tables'
  checksums;
- "fallback" (tests/hostile/test_adversary_process.py): `--spark` with no usable state
  directory (HOME a file, no DCPTOOL_STATE_DIR / XDG_STATE_HOME for this command).

A JVM start that writes to the terminal is pinned by the first command here (-v) and, without
-v, by the first command of tests/replay/test_spark_errors.py's own fresh process."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tests.support import capgen
from tests.support.cli_batch import Call, Ran, run_batch

PASSWORD = "pw-never-in-the-jvm"
REFLECT_SQL = ("SELECT reflect('java.lang.System', 'getenv', 'DCPTOOL_PASSWORD') AS pw, "
               "reflect('java.lang.System', 'getenv', 'SOME_SECRET') AS other, "
               "reflect('java.lang.System', 'getenv', 'PATH') IS NOT NULL AS has_path")
# the tables whose rows depend on shuffles and grouping (the others are covered against local
# by test_spark_equals_local): one core and three partitions give the same rows
LOCAL1_TABLES = ("documents", "undone", "rollbacks", "vbuckets", "snapshots", "history")


@dataclass
class FreshRuns:
    """What each command did, and its inputs."""
    runs: dict[str, Ran]
    cwd: str            # the batch's working directory (empty at its start)
    captures: dict[str, str]
    home: str           # the fallback's HOME: a file, so no state directory can be made


def write_capture(directory: str, seed: int, n: int, **options) -> str:
    capgen.write_captures(capgen.generate("dcp", seed, n_events=n, **options.pop("gen", {})), directory,
                          seed=seed, **options)
    return directory


def run_all(tmp: str) -> FreshRuns:
    """Write the captures under `tmp`, run the batch, return what each command did."""
    caps = {
        # as test_sql_safety's capture_dir, test_replay_spark's _files(tmp, "dcp", 31, n=300) and
        # test_adversary_process's _captures(...)
        "sql-safety": write_capture(os.path.join(tmp, "sqlcaps", "dcp"), 11, 200),
        "local1": write_capture(os.path.join(tmp, "dcp-31-False"), 31, 300, truncate_bytes=0,
                                in_progress_last=False),
        "fallback": write_capture(os.path.join(tmp, "fallback-cap"), 5, 200, gen={"max_captures": 1}),
    }
    cwd = os.path.join(tmp, "cwd")
    os.mkdir(cwd)
    home = os.path.join(tmp, "home-is-a-file")
    open(home, "w").close()
    calls = {
        "sql-safety": Call(["-v", "replay", caps["sql-safety"], "--spark", "--master", "local[1]", "--unsafe-sql",
                            "--sql", REFLECT_SQL, "--format", "jsonl"]),
        "local1": Call(["replay", "--spark", "--master", "local[1]", "--conf", "spark.sql.shuffle.partitions=3",
                        "--checksum", "--format", "jsonl", caps["local1"],
                        *[x for n in LOCAL1_TABLES for x in ("--table", n)]]),
        "fallback": Call(["replay", caps["fallback"], "--spark", "--checksum"],
                         env={"HOME": home, "DCPTOOL_STATE_DIR": None, "XDG_STATE_HOME": None}),
    }
    env = dict(os.environ, DCPTOOL_PASSWORD=PASSWORD, SOME_SECRET="x")
    runs = run_batch(list(calls.values()), env=env, cwd=cwd, timeout=900)
    return FreshRuns(dict(zip(calls, runs)), cwd, caps, home)
