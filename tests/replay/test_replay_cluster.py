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

from dcptool.replay.spark import engine as spark_engine
from dcptool.replay.rules import tables as T

from dcptool.replay.store import reader
from tests.support import capgen
from tests.support.paths import ROOT

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


@pytest.fixture
def cluster(tmp_path):
    """A Master and a Worker that bind port 0 (RPC and web UI) themselves; the Master's log
    says which ports it got."""
    import pyspark
    home = os.path.dirname(pyspark.__file__)
    spark_class = os.path.join(home, "bin", "spark-class")
    env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(tmp_path / "logs"),
               SPARK_WORKER_DIR=str(tmp_path / "work"), PYSPARK_PYTHON=sys.executable)
    master_log, worker_log = tmp_path / "master.log", tmp_path / "worker.log"
    logs = [open(master_log, "wb"), open(worker_log, "wb")]
    procs = [subprocess.Popen([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", "0", "--webui-port", "0"], env=env, stdout=logs[0], stderr=logs[0])]
    try:
        deadline = time.monotonic() + 90
        url = _wait_for_log(master_log, r"Starting Spark master at (spark://127\.0\.0\.1:\d+)", procs[0],
                            deadline).group(1)
        ui = int(_wait_for_log(master_log, r"started service 'MasterUI' on port (\d+)", procs[0], deadline).group(1))
        procs.append(subprocess.Popen([spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                                       "--port", "0", "--webui-port", "0", "--cores", "2",
                                       "--memory", "1g", url], env=env, stdout=logs[1], stderr=logs[1]))
        _wait_for_worker(ui, deadline)
        yield url
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


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
