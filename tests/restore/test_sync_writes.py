"""`restore` of a capture with durable writes (`capture --sync-writes`: prepares, commits,
aborts): a committed document is written with its prepare's value (the frame the plan names,
`_bseq`), CAS and revision, an aborted one as it was before, a deletion as a tombstone; the
target then holds what the source held (documents.py cuts the values in DuckDB)."""

from __future__ import annotations

import json

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.kv_store import store_of
from tests.support.cli_util import capture_files, run
from tests.support.threaded_server import ThreadedServer

VBS = 4


def _state(model) -> dict:
    """key -> (live or deleted, rev, cas, flags, value) of what the bucket holds (a commit is
    its document; a durable write not yet committed is not the document)."""
    st = store_of(model.buckets["default"], model)
    out = {}
    for vb in range(VBS):
        for (cid, key), it in st.vb(vb).docs.items():
            live = it.kind in ("m", "c")
            out[(cid, key)] = ("live" if live else "deleted", it.rev, it.cas, it.flags, it.value if live else b"")
    return out


def test_committed_durable_writes_are_restored_with_their_prepares_value(tmp_path):
    source = P.server_from_options(vbuckets=VBS, items=60, seed=11, checkpoint_items=20)
    bucket = source.buckets["default"]
    bucket.sync_ratio = 0.5
    bucket.mutate_random(300)
    want = _state(source)
    with ThreadedServer(source) as srv:
        files = capture_files(f"couchbase://{srv.host}:{srv.port}/default", tmp_path / "caps", "--sync-writes",
                              "--to", "now")
    assert files
    target = P.server_from_options(vbuckets=VBS, items=0, seed=12)
    with ThreadedServer(target) as srv:
        res = run("restore", str(tmp_path / "caps"), f"couchbase://{srv.host}:{srv.port}/default", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["written"] == len(want) and summary["failed"] == 0
    assert _state(target) == want
    # the capture held durable writes: some documents are commits of prepares
    kinds = {it.kind for vb in bucket.vbuckets for it in vb.mem}
    assert {"p", "c"} <= kinds
