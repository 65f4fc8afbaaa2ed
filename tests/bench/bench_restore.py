"""Benchmark: `dcptool restore` into `serve dcp` against a bare pipelined SET_WITH_META client
writing the same documents into the same kind of server in the same run (1 KiB JSON; one node
and three), and the server's with-meta path against its SET path per write.

    .venv/bin/python tests/bench/bench_restore.py
    BENCH_DOCS=20000 BENCH_NODES=1 .venv/bin/python tests/bench/bench_restore.py

The capture: `serve dcp --items N --value-size 1024` captured `--to now`. Each side gets a
fresh `serve dcp --items 0 --nodes K` (a process of its own) and writes every document once:
restore as a user runs it (the process, from the capture: documents chosen by the replay
engine, values cut from the frames, written with the map), the bare client from frames
encoded before its clock starts (the floor: one connection per node, `WINDOW` requests in
flight on each, no per-document work). Goal (issue 37, printed, not asserted): restore >=
0.7x the bare client's rate; the server's with-meta path no slower per write than its SET
path (the sans-IO producer fed the same number of each, in process, by CPU time: the two
in turn, 256 frames at a time, the median chunk of each). Rounds alternate the two sides
(restore, bare, restore, ...) and the best of each is taken."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time

import _repo  # noqa: F401  (the repository on sys.path)

from dcptool.protocol.dcp.client import kv_writer
from dcptool.protocol.dcp.wire.frames import FrameParser
from dcptool.protocol.transport.kv_restore import KvCluster
from dcptool.replay.store.reader import find_captures
from dcptool.restore.documents import select
from tests.support.paths import DCPTOOL

USER, PASSWORD = "Administrator", "bench-pw"
ENV = dict(os.environ, DCPTOOL_PASSWORD=PASSWORD)
DOCS = int(os.environ.get("BENCH_DOCS", "20000"))
NODES = [int(x) for x in os.environ.get("BENCH_NODES", "1,3").split(",")]
VBS = 64
WINDOW = 64
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))


def serve(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([DCPTOOL, "serve", "dcp", "--port", "0", "--vbuckets", str(VBS), "--user", USER, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    line = json.loads(proc.stdout.readline())
    return proc, line["listening"]


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


def make_capture(tmp: str) -> list:
    proc, addr = serve("--items", str(DOCS), "--value-size", "1024", "--seed", "1")
    try:
        subprocess.run([DCPTOOL, "capture", f"couchbase://{addr}/default", "-o", f"{tmp}/caps", "--quiet", "--user",
                        USER, "--to", "now"], check=True, env=ENV, timeout=600)
    finally:
        stop(proc)
    return find_captures([f"{tmp}/caps"])


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


RESTORE_CPU: list[float] = []


def run_restore(tmp: str, nodes: int) -> float:
    proc, addr = serve("--items", "0", "--nodes", str(nodes))
    try:
        cpu0 = _children_cpu()
        t0 = time.perf_counter()
        res = subprocess.run([DCPTOOL, "restore", f"{tmp}/caps", f"couchbase://{addr}/default", "--user", USER,
                              "--json", "--window", str(WINDOW)], capture_output=True, text=True, env=ENV, timeout=600)
        took = time.perf_counter() - t0
        RESTORE_CPU.append(_children_cpu() - cpu0)     # the restore process's CPU (user + system)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["written"] == DOCS, res.stdout
        return took
    finally:
        stop(proc)


async def _bare(addr: str, docs: list) -> float:
    host, _, port = addr.rpartition(":")
    cluster = KvCluster([(host, int(port))], "default", USER, PASSWORD, window=WINDOW)
    await cluster.connect()
    by_node: dict[str, list[bytes]] = {}
    for i, d in enumerate(docs):
        vb = kv_writer.vbucket_of(d.key, cluster.num_vbuckets)
        by_node.setdefault(cluster.owner(vb) or "", []).append(
            kv_writer.write_frame(d, vbucket=vb, opaque=i, force=False, collections=True))
    links = {a: await cluster.link_to(a) for a in by_node}
    for link in links.values():          # the bare loop owns the sockets from here
        link.task.cancel()

    async def pump(address: str, frames: list[bytes]) -> None:
        link = links[address]
        parser = FrameParser()
        sent = answered = 0
        while answered < len(frames):
            while sent < len(frames) and sent - answered < WINDOW:
                link.writer.write(frames[sent])
                sent += 1
            data = await link.reader.read(1 << 18)
            assert data, "the server closed the connection"
            got = parser.feed(data)
            for fr in got:
                assert fr.vbucket_or_status == 0, fr.vbucket_or_status
            answered += len(got)
    t0 = time.perf_counter()
    await asyncio.gather(*(pump(a, f) for a, f in by_node.items()))
    took = time.perf_counter() - t0
    for link in links.values():
        link.writer.close()
    return took


def run_bare(nodes: int, docs: list) -> float:
    proc, addr = serve("--items", "0", "--nodes", str(nodes))
    try:
        return asyncio.run(_bare(addr, docs))
    finally:
        stop(proc)


def server_paths(n: int) -> tuple[float, float]:
    """Seconds per write of the sans-IO producer: SET against SET_WITH_META, n of each."""
    import struct

    from dcptool.protocol.dcp.server import producer as P
    from dcptool.protocol.dcp.server.bucket import vbucket_of
    from dcptool.protocol.dcp.wire import messages as m
    from dcptool.protocol.dcp.wire.constants import Feature

    def conn():
        model = P.server_from_options(vbuckets=VBS, items=0, seed=1)
        c = model.connect(0.0)
        c.receive(m.encode(m.Hello(features=(Feature.XERROR, Feature.JSON, Feature.SELECT_BUCKET))) +
                  m.encode(m.SelectBucket(bucket=b"default")), 0.0)
        c.pull(0.0)
        return c
    value = b'{"v":"' + b"x" * 1010 + b'"}'
    keys = [b"k-%07d" % i for i in range(n)]
    sets = [m.encode(m.Request(opcode=0x01, opaque=i, key=k, vbucket=vbucket_of(k, VBS), datatype=1,
                               extras=struct.pack(">II", 0, 0), value=value)) for i, k in enumerate(keys)]
    metas = [kv_writer.write_frame(kv_writer.Doc(key=k, collection_id=0, rev_seqno=1, cas=(1 << 60) + i, flags=0,
                                                 expiry=0, datatype=1, deleted=False, value=value),
                                   vbucket=vbucket_of(k, VBS), opaque=i, force=False, collections=False)
             for i, k in enumerate(keys)]

    def round_() -> list[tuple[float, float]]:
        # the two paths in turn, 256 frames at a time (each on a server of its own), so a
        # change of the host's load meets both; CPU time of this thread (the run queue of a
        # loaded host left out). The heap is frozen as `serve dcp` freezes it (reaper.py:
        # what survives, once a second there, every 64 chunks here): the collector's walks of
        # this benchmark's own heap (the documents listed above) are no path's cost
        conns, chunks = (conn(), conn()), []
        gc.collect()
        gc.freeze()
        for i in range(0, n, 256):
            if i % (64 * 256) == 0:
                gc.collect(1)
                gc.freeze()
            spent = []
            for side, frames in enumerate((sets, metas)):
                t0 = time.thread_time()
                conns[side].receive(b"".join(frames[i:i + 256]), 0.0)
                conns[side].pull(0.0)
                spent.append((time.thread_time() - t0) / len(frames[i:i + 256]))
            chunks.append((spent[0], spent[1]))
        return chunks
    try:
        chunks = [c for _ in range(max(ROUNDS, 5)) for c in round_()]
    finally:
        gc.unfreeze()
    # the median chunk of each side: a chunk that met a burst of the host's load (its cache,
    # its sibling thread) counts no more than any other
    return statistics.median(c[0] for c in chunks), statistics.median(c[1] for c in chunks)


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="bench-restore-")
    try:
        files = make_capture(tmp)
        docs = [c.doc for c in select(files)]
        assert len(docs) == DOCS, len(docs)
        print(f"{DOCS} documents of 1 KiB JSON, {VBS} vbuckets, window {WINDOW}, best of {ROUNDS}")
        for nodes in NODES:
            # the two sides in turn, so a change of the host's load meets both
            rounds = [(run_restore(tmp, nodes), run_bare(nodes, docs)) for _ in range(ROUNDS)]
            restore, bare = min(r for r, _ in rounds), min(b for _, b in rounds)
            cpu = min(RESTORE_CPU[-ROUNDS:])
            print(f"nodes={nodes}: restore {DOCS / restore:,.0f} docs/s ({restore:.2f} s, the whole process, "
                  f"{cpu:.2f} s CPU: {cpu / DOCS * 1e6:.0f} us/doc), "
                  f"bare SET_WITH_META client {DOCS / bare:,.0f} docs/s ({bare:.2f} s): ratio {bare / restore:.2f}x "
                  "(goal >= 0.7x)")
        s, w = server_paths(min(DOCS, 20000))
        print(f"server per write: SET {s * 1e6:.1f} us, SET_WITH_META {w * 1e6:.1f} us: with-meta/SET "
              f"{w / s:.2f}x (goal <= 1.0x)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
