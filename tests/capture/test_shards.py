"""`capture --shard K/N`: each process streams the vbuckets with vb % N == K - 1, records its
shard in the segments' metadata, and N of them write one directory at once; replay merges
them, verify names the vbuckets of a shard that is missing (exit 6)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pyarrow.parquet as pq
import pytest

from dcptool.capture.shard import check_shard, shard_name, shard_vbuckets
from dcptool.protocol.dcp.client.routing import Router
from dcptool.protocol.errors import LateUsageError
from dcptool.replay.check.verify import verify
from dcptool.replay.store.reader import find_captures
from tests.support.cli_util import run
from tests.support.paths import DCPTOOL
from tests.support.ring_caps import dcp_capture

DROP = ("capture_id", "frame_no", "ts")     # where the shards' rows differ from a single capture's


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Two shard processes at once into one directory, and one capture of everything, of
    the same seeded producer (8 vbuckets)."""
    from dcptool.protocol.dcp.server import producer as P
    from tests.support.threaded_server import ThreadedServer
    base = tmp_path_factory.mktemp("shards")
    model = P.server_from_options(vbuckets=8, items=400, seed=7)
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        procs = [subprocess.Popen([DCPTOOL, "capture", url, "-o", str(base / "sharded"), "--shard", f"{k}/2",
                                   "--quiet", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for k in (1, 2)]
        outs = [p.communicate(timeout=120) for p in procs]
    for p, (_o, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert dcp_capture(base / "one", vbuckets=8, items=400, seed=7)["error"] is None
    return base


def _documents(path) -> list[str]:
    from dcptool.replay.local import engine as local
    t = local.replay_local(find_captures([str(path)])).table("documents")
    rows = t.drop_columns([c for c in DROP if c in t.column_names]).to_pylist()
    return sorted(json.dumps({k: v for k, v in r.items() if k not in DROP}, sort_keys=True, default=str)
                  for r in rows)


def test_two_shards_at_once_replay_as_one_capture(captured):
    files = find_captures([str(captured / "sharded")])
    assert len({f.capture_id for f in files}) == 2
    vbs = {}
    for f in files:
        shard = json.loads(f.metadata["dcptool.options"])["shard"]
        t = pq.read_table(f.path, columns=["vbucket", "op"])
        vbs[shard] = sorted({v for v, op in zip(t.column("vbucket").to_pylist(), t.column("op").to_pylist())
                             if op == "mutation"})
    assert vbs == {"1/2": [0, 2, 4, 6], "2/2": [1, 3, 5, 7]}
    docs = _documents(captured / "sharded")
    assert len(docs) == 400 and docs == _documents(captured / "one")
    assert verify([str(captured / "sharded")]).counts == {}


def test_a_missing_shard_is_named_by_its_vbuckets(captured, tmp_path):
    part = tmp_path / "part"
    part.mkdir()
    for f in find_captures([str(captured / "sharded")]):
        if json.loads(f.metadata["dcptool.options"])["shard"] == "1/2":
            shutil.copy(f.path, part)
    res = run("verify", str(part), "--format", "jsonl")
    assert res.returncode == 6, res.stdout + res.stderr
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    assert [r["check"] for r in rows] == ["dcp.shard_missing"]
    assert "shard 2/2 absent: vbuckets 1,3,5,7 not captured" in rows[0]["message"]


def test_shard_is_a_usage_error_for_synapse_and_when_malformed():
    res = run("capture", "synapse://127.0.0.1:9/", "--shard", "1/2", "-o", "/nonexistent-never-made")
    assert res.returncode == 2 and "--shard is for DCP" in res.stderr and "Traceback" not in res.stderr
    res = run("capture", "couchbase://127.0.0.1:9/default", "--shard", "3/2")
    assert res.returncode == 2 and "--shard 3/2: K/N needs" in res.stderr and "Traceback" not in res.stderr
    for bad in ("0/2", "x", "1/0", "1/2048"):
        with pytest.raises(LateUsageError):
            check_shard(bad)


def test_the_shard_vbuckets_and_names():
    class O:
        shard, vbuckets = "2/3", list(range(10))
    assert shard_vbuckets(O) == [1, 4, 7]
    O.vbuckets = [0, 3]
    with pytest.raises(LateUsageError):
        shard_vbuckets(O)
    assert check_shard(" 2 / 3 ") == "2/3" and shard_name("n", "2/3") == "n-shard-2-of-3"
    r = Router(None, shard=(1, 4))
    r.config = type("C", (), {"num_vbuckets": 16})()
    assert r.wanted() == [1, 5, 9, 13]
