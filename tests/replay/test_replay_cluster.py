"""Replay on a real standalone Spark cluster (a Master and one Worker from the pyspark
package, on 127.0.0.1, started and stopped here) gives the checksums of a local session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from dcptool.replay.spark import engine as spark_engine
from dcptool.replay.rules import tables as T

from dcptool.replay.store import reader
from tests.support import capgen
from tests.conftest import free_port

pytestmark = [pytest.mark.spark, pytest.mark.integration]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


@pytest.fixture
def cluster(tmp_path):
    import pyspark
    home = os.path.dirname(pyspark.__file__)
    spark_class = os.path.join(home, "bin", "spark-class")
    port, ui, wport, wui = free_port(), free_port(), free_port(), free_port()
    env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(tmp_path / "logs"),
               SPARK_WORKER_DIR=str(tmp_path / "work"), PYSPARK_PYTHON=sys.executable)
    log = open(tmp_path / "cluster.log", "wb")
    procs = [subprocess.Popen([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(ui)], env=env, stdout=log, stderr=log)]
    try:
        procs.append(subprocess.Popen([spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                                       "--port", str(wport), "--webui-port", str(wui), "--cores", "2",
                                       "--memory", "1g", f"spark://127.0.0.1:{port}"],
                                      env=env, stdout=log, stderr=log))
        _wait_for_worker(ui, time.monotonic() + 90)
        yield f"spark://127.0.0.1:{port}"
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()


def test_standalone_cluster_gives_local_checksums(spark, cluster, tmp_path):
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
    proc = subprocess.run([sys.executable, "-m", "dcptool.cli", "replay", "--master", cluster,
                           "--conf", "spark.executor.memory=768m", "--checksum", "--format", "jsonl", str(d)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    got = {r["table"]: r["sha256"] for r in map(json.loads, proc.stdout.splitlines())}
    assert got == want
