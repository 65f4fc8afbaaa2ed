"""Issue 37's "what it must show" for bodies: the official Couchbase Python SDK writes JSON
and binary documents (some with expiry, some removed, some replaced) into `serve dcp`;
`dcptool capture --compress` (Snappy negotiated: values arrive compressed) records the bucket;
the replayed `documents` bodies equal what the SDK reads back, flags and CAS included,
and the expiry the SDK set; a JSON field read by `--sql` on both engines (DuckDB's `->>`, Spark's
`get_json_object`) equals the SDK's."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from datetime import timedelta

import pytest

couchbase = pytest.importorskip("couchbase")

from couchbase.options import GetOptions, RemoveOptions, ReplaceOptions, UpsertOptions  # noqa: E402
from couchbase.transcoder import Transcoder  # noqa: E402

from dcptool.replay.local import engine as local  # noqa: E402
from dcptool.replay.spark import engine as spark_engine  # noqa: E402
from dcptool.replay.store import reader  # noqa: E402
from tests.support.chaos_sdk import connect as sdk_connect  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.spark]
DCPTOOL = os.path.join(os.path.dirname(sys.executable), "dcptool")
USER, PASSWORD = "Administrator", "bodies-sdk-pw"
ENV = dict(os.environ, DCPTOOL_PASSWORD=PASSWORD)
BOUND = 120
JSON_FLAGS, BINARY_FLAGS = 0x02000006, 0x03000000     # the SDK's common flags


class Raw(Transcoder):
    """Bytes as they are, with the flags given (JSON or binary): what was written and read
    back, byte for byte and flag for flag."""

    def __init__(self, flags: int = BINARY_FLAGS):
        self.flags = flags

    def encode_value(self, value):
        return value, self.flags

    def decode_value(self, value, flags):
        return bytes(value), flags


def _write(coll, rng: random.Random) -> None:
    """JSON and binary documents, some with an expiry, some replaced (with their CAS), some removed."""
    for i in range(60):
        key = f"doc-{i:02d}"
        if i % 3 == 2:
            body, flags = rng.randbytes(rng.randrange(1, 300)), BINARY_FLAGS
        else:
            body = json.dumps({"type": rng.choice(["order", "user"]), "n": i, "name": f"n\u00e9-{i}",
                               "pad": "x" * rng.randrange(0, 600)}, ensure_ascii=False).encode()
            flags = JSON_FLAGS
        opts = UpsertOptions(transcoder=Raw(flags))
        if i % 5 == 0:
            opts = UpsertOptions(transcoder=Raw(flags), expiry=timedelta(hours=2))
        res = coll.upsert(key, body, opts)
        if i % 4 == 1:      # replaced, with its CAS
            new = json.dumps({"type": "replaced", "n": i * 10, "name": "r\u00e9"}).encode()
            coll.replace(key, new, ReplaceOptions(cas=res.cas, transcoder=Raw(JSON_FLAGS)))
        if i % 7 == 3:
            coll.remove(key, RemoveOptions())


@pytest.fixture
def served():
    p = subprocess.Popen([DCPTOOL, "serve", "dcp", "--items", "0", "--port", "0", "--vbuckets", "16",
                          "--user", USER, "--seed", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=ENV)
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        yield json.loads(line)["listening"]
    finally:
        p.terminate()
        p.wait(BOUND)


def test_sdk_bodies_equal_the_replayed_documents(served, tmp_path, spark):
    host, port = served.rsplit(":", 1)
    cluster, coll = sdk_connect(host, int(port), password=PASSWORD, kv_timeout=10.0, durable_timeout=10.0,
                                connect_timeout=20.0)
    try:
        written = time.time()
        _write(coll, random.Random(37))
        truth, gone = {}, set()
        for i in range(60):
            key = f"doc-{i:02d}"
            if not coll.exists(key).exists:
                gone.add(key)
                continue
            got = coll.get(key, GetOptions(transcoder=Raw()))
            body, flags = got.value
            # the expiry the SDK set: two hours from the write (`serve dcp` has no lookup of it); a
            # replace without one clears it
            truth[key] = (body, flags, got.cas, int(key[4:]) % 5 == 0 and int(key[4:]) % 4 != 1)
    finally:
        cluster.close()
    out = tmp_path / "cap"
    cap = subprocess.run([DCPTOOL, "capture", f"couchbase://{served}/default", "--user", USER, "--to", "now",
                          "--compress", "-o", str(out), "--quiet"], capture_output=True, text=True, timeout=BOUND,
                         env=ENV)
    assert cap.returncode == 0, cap.stderr
    files = reader.find_captures([str(out)])
    docs = {r["key"].decode(): r for r in local.replay_local(files, tables=["documents"]).table("documents").to_pylist()}
    assert {k for k, r in docs.items() if r["state"] == "live"} == set(truth)
    assert {k for k, r in docs.items() if r["state"] == "deleted"} == gone and gone
    assert any((r["datatype"] or 0) & 2 for r in docs.values())          # Snappy as sent
    for key, (body, flags, cas, expiry) in truth.items():
        r = docs[key]
        assert (r["value"], r["item_flags"], r["cas"]) == (body, flags, cas), key
        if expiry:
            assert abs(r["expiration"] - (written + 7200)) < 120, key
        else:
            assert r["expiration"] == 0, key
        assert r["value_json"] == (body.decode() if flags == JSON_FLAGS else None), key
    assert any(e for _, _, _, e in truth.values())
    # a JSON field by --sql: DuckDB in a replay process, Spark on the shared session
    sql = "SELECT decode(key) AS k, value_json->>'$.name' AS name FROM documents WHERE state = 'live'"
    rep = subprocess.run([DCPTOOL, "replay", str(out), "--sql", sql, "--format", "jsonl"], capture_output=True,
                         text=True, timeout=BOUND)
    assert rep.returncode == 0, rep.stderr
    duck = {r["k"]: r["name"] for r in map(json.loads, rep.stdout.splitlines())}
    srep = spark_engine.replay_spark(spark, files)
    try:
        srep.register_views({"documents"})
        rows = spark.sql("SELECT CAST(key AS STRING) AS k, get_json_object(value_json, '$.name') AS name "
                         "FROM documents WHERE state = 'live'").collect()
    finally:
        srep.close()
    sdk = {k: (json.loads(b)["name"] if f == JSON_FLAGS else None) for k, (b, f, _, _) in truth.items()}
    assert duck == sdk
    assert {r["k"]: r["name"] for r in rows} == sdk
