"""Shared fixtures, once per pytest-xdist worker (`make test` runs two, a file at a time):
the run's own state directory, one local SparkSession (bound to 127.0.0.1), one warm Spark
Connect server, a failover capture, and the fresh-process `replay --spark` commands run in one
process. Helpers that tests import live
in tests/support/ (paths, ports, ...), never here: no test imports conftest."""

from __future__ import annotations

import os

import pytest

from tests.support.paths import DCPTOOL
from tests.support.spark_jvm import JVM_OPTS


@pytest.fixture(scope="session", autouse=True)
def _own_state_dir(tmp_path_factory):
    """`replay --spark` uses a warm server recorded in the state directory: not the user's."""
    os.environ["DCPTOOL_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    os.environ.setdefault("DCPTOOL_SPARK_CDS", "0")   # no 180 MB class archive per test run (test_spark_cds.py)
    # Every JVM the suite starts lives for seconds to minutes on tiny data: C1 only and the
    # serial collector halve its CPU (JIT and GC threads), with the same results. pyspark's
    # launcher adds SPARK_SUBMIT_OPTS to every driver it starts (the shared session, fresh
    # `replay --spark` processes, the warm server, the cluster test's driver), spark-class
    # SPARK_DAEMON_JAVA_OPTS to a standalone Master and Worker; neither prints anything.
    os.environ.setdefault("SPARK_SUBMIT_OPTS", JVM_OPTS)
    os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", JVM_OPTS)


@pytest.fixture(scope="session")
def spark():
    """One local[2] session for every Spark test of this pytest-xdist worker: UI off, few shuffle partitions, driver
    bound to loopback."""
    from dcptool.replay.spark.engine import make_session
    session = make_session("local[2]", app_name="dcptool-tests",
                           conf={"spark.sql.shuffle.partitions": "4"})
    yield session
    session.stop()


@pytest.fixture(scope="session")
def warm_server(tmp_path_factory):
    """The suite's warm Spark Connect server (tests/support/warm_server.py), started by the
    first test that `ensure()`s it, stopped at the end of the run."""
    from tests.support.warm_server import WarmServer
    server = WarmServer(str(tmp_path_factory.mktemp("warm-state")))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def failover_capture(tmp_path_factory):
    """A capture from the built-in producer with a forced failover (rollbacks on the resumed
    streams): (the producer's model, the capture files). Made once for the whole run."""
    import subprocess

    from dcptool.protocol.dcp.server import producer as P
    from dcptool.replay.store.reader import find_captures
    from tests.support.threaded_server import ThreadedServer
    out = tmp_path_factory.mktemp("failover") / "caps"
    model = P.server_from_options(vbuckets=16, items=4000, seed=21,
                                  scenarios=P.Scenarios(failover_at=2500, failover_loss=12))
    with ThreadedServer(model) as srv:
        res = subprocess.run([DCPTOOL, "capture", f"couchbase://{srv.host}:{srv.port}/default", "-o", str(out),
                              "--quiet"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return model, find_captures([str(out)])


@pytest.fixture(scope="session")
def fresh_spark_cli(tmp_path_factory):
    """The `replay --spark` commands about a fresh process (SQL safety, local[1], the
    embedded fallback) run once, in ONE fresh process: one JVM start for the three
    (tests/support/fresh_spark.py says which runs first and why)."""
    from tests.support import fresh_spark
    return fresh_spark.run_all(str(tmp_path_factory.mktemp("fresh-spark")))


@pytest.fixture
def serve():
    """`serve(*args)` starts `dcptool serve synapse` (tests/support/synapse_serve.py) with
    those arguments; every server a test started is stopped after it."""
    from tests.support.synapse_serve import ServeSynapse
    started = []

    def start(*args):
        s = ServeSynapse(*args)
        started.append(s)
        return s
    yield start
    for s in started:
        s.stop()

