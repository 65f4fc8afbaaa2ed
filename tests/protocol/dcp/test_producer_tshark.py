"""Frames the producer sends in a real loopback session decode in Wireshark's couchbase
dissector (tshark) exactly as in our decoder, for the fields tshark decodes correctly
(tests/support/tshark_util.py lists what it gets wrong). The session's bytes, both directions in
wire order, are written to a pcap as TCP segments and handed to `tshark -r`."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.wire import messages as M
from dcptool.protocol.transport.dcp_client import Session
from tests.support.threaded_server import ThreadedServer
from tests.support.tshark_util import Recorder, compare, require_tshark, tshark_frames

pytestmark = pytest.mark.integration


def _session(collections: bool) -> tuple[Recorder, int]:
    model = P.server_from_options(vbuckets=4, items=120, seed=21, users={"admin": "pw"}, checkpoint_items=10)
    model.buckets["default"].mutate_random(60)    # memory snapshots: updates, deletions, expirations
    rec = Recorder()
    with ThreadedServer(model) as srv:
        cfg = dcp_consumer.ConsumerConfig(bucket="default", name="tshark", user="admin", password="pw",
                               collections=collections, buffer_size=4096, noop_interval=5)
        consumer = asyncio.run(asyncio.wait_for(Session(cfg, srv.host, srv.port, tap=rec).run(), 60))
        port = srv.port
    assert consumer.finished
    return rec, port


@pytest.mark.parametrize("collections", [False, True])
def test_producer_session_decodes_the_same_in_tshark(collections):
    require_tshark()
    rec, port = _session(collections)
    pdus = tshark_frames(rec.segments, port=port)
    assert len(pdus) == len(rec.frames)
    problems = []
    ops = Counter()
    for (from_server, raw), ts in zip(rec.frames, pdus):
        row = M.to_row(M.decode_bytes(raw, collections=collections))
        assert row.get("decode_error") is None, row
        ops[(from_server, row["op"])] += 1
        problems += [f"{row['op']}: {d}" for d in compare(row, raw, ts)]
    assert problems == []
    # the session really covered the producer's repertoire
    for op in ("hello", "sasl_list_mechs", "sasl_auth", "sasl_step", "select_bucket", "open", "control",
               "stream_req", "snapshot_marker", "mutation", "deletion", "stream_end"):
        assert ops[(True, op)] > 0, op
    assert ops[(False, "buffer_ack")] > 0
