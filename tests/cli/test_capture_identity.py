"""One source per capture directory, judged by the source's identity (issue 36, finding 13):
the bucket's UUID of a DCP source (its GET_CLUSTER_CONFIG after SELECT_BUCKET), the server
name of a Synapse source (its SERVER line), whatever host and port it answers on. Another
identity into a directory is exit 2 with one line naming both, unless `--force-new` (a new
capture next to the old one, which stays as it was); a source that gives none falls back to
the host rule (CAPTURE_FORMAT.md "One source per directory")."""

from __future__ import annotations

import os

import pyarrow as pa

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.wire import cluster_config
from dcptool.replay.store import resume as R
from dcptool.replay.store import schema as S
from dcptool.replay.store.reader import describe
from dcptool.replay.store.writer import CaptureWriter
from tests.support.cli_util import error_line, run
from tests.support.synapse_serve import ServeSynapse
from tests.support.threaded_server import ThreadedServer

ITEMS = 60


def _model(seed: int):
    return P.server_from_options(vbuckets=4, items=ITEMS, seed=seed)


def _capture(url: str, out, *args: str):
    return run("capture", url, "-o", str(out), "--quiet", *args)


def _files(directory) -> dict[str, bytes]:
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


def _source_ids(directory) -> dict[str, str | None]:
    """capture id -> its `dcptool.source_id`, over every segment (one value per capture)."""
    out: dict[str, str | None] = {}
    for n in sorted(os.listdir(directory)):
        if n.endswith(".parquet"):
            f = describe(os.path.join(directory, n))
            sid = f.metadata.get(S.META_SOURCE_ID)
            assert out.setdefault(f.capture_id, sid) == sid, n
    return out


def test_a_single_node_answers_its_bucket_uuid_stable_for_the_seed():
    """GET_CLUSTER_CONFIG of a single node carries the bucket's uuid: the same for the same
    seed and bucket, another for another seed (it was one uuid for every server)."""
    uuids = []
    for seed in (1, 1, 2):
        model = _model(seed)
        model.bind_node(0, "127.0.0.1", 11210)
        cl = model.cluster_for(model.buckets["default"])
        assert cl is not None
        uuids.append(cluster_config.bucket_uuid(cl.render(0)))
    assert len(uuids[0]) == 32 and uuids[0] == uuids[1] != uuids[2]


def test_another_bucket_on_another_port_of_the_same_host_is_exit_2(tmp_path):
    cap = tmp_path / "cap"
    with ThreadedServer(_model(1)) as a, ThreadedServer(_model(2)) as b:
        assert _capture(f"couchbase://{a.host}:{a.port}/default", cap).returncode == 0
        before = _files(cap)
        uuid_a, uuid_b = (s.server.model.cluster.uuid for s in (a, b))
        for extra in ([], ["--resume"]):
            res = _capture(f"couchbase://{b.host}:{b.port}/default", cap, *extra)
            assert res.returncode == 2, res.stderr
            line = error_line(res)      # one line, both identities, both addresses
            assert f"bucket uuid {uuid_a}" in line and f"bucket uuid {uuid_b}" in line, line
            assert f":{a.port}/default" in line and f":{b.port}/default" in line, line
            assert _files(cap) == before     # nothing of the other bucket written
    assert run("verify", str(cap)).returncode == 0


def test_the_same_bucket_restarted_on_another_port_resumes(tmp_path):
    cap = tmp_path / "cap"
    with ThreadedServer(_model(1)) as a:
        assert _capture(f"couchbase://{a.host}:{a.port}/default", cap).returncode == 0
        uuid = a.server.model.cluster.uuid
    with ThreadedServer(_model(1)) as again:      # the same bucket, another port
        res = _capture(f"couchbase://{again.host}:{again.port}/default", cap, "--resume")
        assert res.returncode == 0, res.stderr
    ids = _source_ids(cap)
    assert len(ids) == 2 and set(ids.values()) == {f"bucket-uuid:{uuid}"}, ids
    assert run("verify", str(cap)).returncode == 0


def test_force_new_starts_a_new_capture_next_to_the_old_one(tmp_path):
    """--force-new: a new capture id in the directory, the other bucket's segments kept as they
    were (its retention ring counts only its own: --retain-segments 1 leaves the old one);
    both are recorded with their identity, verify flags the mix, --resume there is refused."""
    cap = tmp_path / "cap"
    with ThreadedServer(_model(1)) as a, ThreadedServer(_model(2)) as b:
        assert _capture(f"couchbase://{a.host}:{a.port}/default", cap).returncode == 0
        before = _files(cap)
        url_b = f"couchbase://{b.host}:{b.port}/default"
        res = _capture(url_b, cap, "--force-new", "--retain-segments", "1")
        assert res.returncode == 0, res.stderr
        after = _files(cap)
        assert all(after.get(n) == data for n, data in before.items()), "the old capture changed"
        ids = _source_ids(cap)
        assert sorted(ids.values()) == sorted(f"bucket-uuid:{s.server.model.cluster.uuid}" for s in (a, b)), ids
        res = _capture(url_b, cap, "--resume")
        assert res.returncode == 2 and "--resume continues the capture of bucket uuid" in error_line(res)
    res = run("verify", str(cap), "--format", "jsonl")
    assert res.returncode == 6 and '"file.mixed_sources"' in res.stdout, res.stdout[-2000:]


def test_another_synapse_server_name_at_the_same_address_is_exit_2(tmp_path):
    cap = tmp_path / "cap"
    args = ("--max-messages", "40", "--duration", "60s")
    with ServeSynapse("--server-name", "alpha.example", "--items", "100") as a:
        address = a.address
        assert _capture(f"synapse://{address}", cap, *args).returncode == 0
    before = _files(cap)
    with ServeSynapse("--port", address.rpartition(":")[2], "--server-name", "beta.example", "--items", "100") as b:
        assert b.address == address
        for extra in ([], ["--resume"]):
            res = _capture(f"synapse://{address}", cap, *args, *extra)
            assert res.returncode == 2, res.stderr
            line = error_line(res)
            assert "server name alpha.example" in line and "server name beta.example" in line, line
            assert _files(cap) == before
    assert set(_source_ids(cap).values()) == {"server-name:alpha.example"}


def _recorded(directory, source: str, source_id: str) -> None:
    w = CaptureWriter(directory, "dcp", source=source, options={})
    w.set_options({}, source_id)
    w.write(pa.RecordBatch.from_pydict({"frame_no": pa.array([0], pa.int64()), "direction": ["in"],
                                        "raw": [b"\x80" + bytes(23)]}))
    w.close()


def test_a_source_without_an_identity_falls_back_to_the_host_rule(tmp_path):
    """A server that gives no uuid (an older one, a recording): the host rule decides; where
    both sides give one, the identity decides whatever the host."""
    cap = tmp_path / "cap"
    _recorded(cap, "couchbase://10.0.0.1:11210/default", "bucket-uuid:aa")
    R.check_identity(cap, "dcp", "couchbase://10.0.0.1:12000/default", "", resume=True, force_new=False)
    for url, sid in (("couchbase://10.0.0.2:11210/default", ""), ("couchbase://10.0.0.1:11210/default", "bucket-uuid:bb")):
        try:
            R.check_identity(cap, "dcp", url, sid, resume=True, force_new=False)
        except R.SourceMismatch as exc:
            assert "10.0.0.1:11210" in str(exc) and "\n" not in str(exc)
        else:
            raise AssertionError(f"{url} {sid} accepted")
    R.check_identity(cap, "dcp", "couchbase://10.0.0.9:11210/default", "bucket-uuid:aa", resume=True, force_new=False)
    # before connecting: another host is for the identity to decide, another bucket is not
    R.check_source(cap, "dcp", "couchbase://10.0.0.9:11210/default", resume=True, force_new=False)
    try:
        R.check_source(cap, "dcp", "couchbase://10.0.0.1:11210/other", resume=True, force_new=False)
    except R.SourceMismatch as exc:
        assert "bucket uuid aa" in str(exc)
    else:
        raise AssertionError("another bucket name accepted")


def test_a_synapse_reconnect_that_reaches_another_server_ends_the_run(tmp_path):
    """The identity settles on the first SERVER line; a later one naming another server (a
    reconnect reached another Synapse at the address) ends the run before its lines are
    recorded, naming both."""
    from dcptool.capture.options import CaptureSettings, LiveOptions
    from dcptool.capture.sources import parse_source
    from dcptool.capture.synapse_capture import Identity

    class Writer:
        source_id = None

        def set_options(self, options, source_id=None):
            self.source_id = source_id

    opts = LiveOptions(source=parse_source("synapse://127.0.0.1:9092"), user=None)
    writer = Writer()
    ident = Identity(opts, CaptureSettings(output=str(tmp_path / "cap")), writer, {}, None)
    assert ident.source_id is None          # the URL names no server: the SERVER line will
    ident.seen("alpha.example")
    ident.seen(None)                        # reconnecting: no SERVER line yet
    ident.seen("alpha.example")
    assert ident.source_id == writer.source_id == "server-name:alpha.example"
    try:
        ident.seen("beta.example")
    except R.SourceMismatch as exc:
        assert "server name alpha.example" in str(exc) and "server name beta.example" in str(exc)
    else:
        raise AssertionError("another server accepted")
