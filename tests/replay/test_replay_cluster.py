"""Replay on a real standalone Spark cluster (a Master and one Worker from the pyspark
package, on 127.0.0.1, started and stopped here) gives the checksums of a local session."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from dcptool.replay.rules import tables as T
from dcptool.replay.spark import engine as spark_engine
from dcptool.replay.store import reader
from tests.support import capgen
from tests.support.paths import ROOT
from tests.support.spark_jvm import JVM_OPTS

pytestmark = [pytest.mark.spark, pytest.mark.integration]


def _wait_for_log(path, pattern: str, proc: subprocess.Popen, deadline: float) -> re.Match:
    """The first match of `pattern` in a JVM's log: the Master reports the ports it bound."""
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text(errors="replace"))
        if found:
            return found
        if proc.poll() is not None:
            break
        time.sleep(0.2)  # polling the log for the condition, bounded by the deadline
    raise AssertionError(f"no {pattern!r} in {path}:\n{path.read_text(errors='replace')[-3000:]}")


def _wait_for_worker(ui_port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as resp:
                state = json.load(resp)
            if any(w.get("state") == "ALIVE" for w in state.get("workers", [])):
                return
        except OSError:
            pass
        time.sleep(0.5)  # polling for readiness, bounded by the deadline
    raise AssertionError("the standalone Spark worker did not register in time")


class Cluster:
    """A Master and a Worker that bind port 0 (RPC and web UI) themselves; the Master's log
    says which ports it got. The Master starts at once; `master_url()` waits for it and starts
    the Worker, whose registration `wait_for_worker()` waits for (a driver started meanwhile
    waits for its executor itself): the JVM starts overlap the test's own work."""

    def __init__(self, tmp_path):
        import pyspark
        home = os.path.dirname(pyspark.__file__)
        self.spark_class = os.path.join(home, "bin", "spark-class")
        self.env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(tmp_path / "logs"),
                        SPARK_WORKER_DIR=str(tmp_path / "work"), PYSPARK_PYTHON=sys.executable)
        self.master_log, self.worker_log = tmp_path / "master.log", tmp_path / "worker.log"
        self.logs = [open(self.master_log, "wb"), open(self.worker_log, "wb")]
        self.deadline = 0.0
        self.procs = [subprocess.Popen([self.spark_class, "org.apache.spark.deploy.master.Master", "--host",
                                        "127.0.0.1", "--port", "0", "--webui-port", "0"], env=self.env,
                                       stdout=self.logs[0], stderr=self.logs[0])]
        self.ui = None

    def master_url(self) -> str:
        self.deadline = time.monotonic() + 90   # from now: the test's own work came first
        url = _wait_for_log(self.master_log, r"Starting Spark master at (spark://127\.0\.0\.1:\d+)", self.procs[0],
                            self.deadline).group(1)
        self.ui = int(_wait_for_log(self.master_log, r"started service 'MasterUI' on port (\d+)", self.procs[0],
                                    self.deadline).group(1))
        self.procs.append(subprocess.Popen([self.spark_class, "org.apache.spark.deploy.worker.Worker", "--host",
                                            "127.0.0.1", "--port", "0", "--webui-port", "0", "--cores", "2",
                                            "--memory", "1g", url], env=self.env, stdout=self.logs[1],
                                           stderr=self.logs[1]))
        return url

    def wait_for_worker(self) -> None:
        _wait_for_worker(self.ui, time.monotonic() + 90)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def test_standalone_cluster_gives_local_checksums(spark, cluster, tmp_path):
    # while the Master's JVM starts: the capture, and its checksums on the shared local session
    d = tmp_path / "cap"
    capgen.write_captures(capgen.generate("dcp", 123, n_events=400), str(d), seed=1,
                          in_progress_last=True, truncate_bytes=5)
    files = reader.find_captures([str(d)])
    rep = spark_engine.replay_spark(spark, files)
    try:
        want = {n: T.checksum(n, rep.table(n)) for n in rep.names() if n != "frames"}
    finally:
        rep.close()
    env = dict(os.environ, PYTHONPATH=ROOT, PYSPARK_PYTHON=sys.executable)
    url = cluster.master_url()
    # the driver starts while the Worker registers; its application waits for the executor
    with subprocess.Popen([sys.executable, "-m", "dcptool.cli", "replay", "--master", url,
                           "--conf", "spark.executor.memory=768m", "--conf", f"spark.executor.extraJavaOptions={JVM_OPTS}",
                           "--checksum", "--format", "jsonl", str(d)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            cluster.wait_for_worker()
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    got = {r["table"]: r["sha256"] for r in map(json.loads, out.splitlines())}
    assert got == want
