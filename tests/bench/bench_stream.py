"""Benchmark: `dcptool stream --format jsonl > /dev/null` against `dcptool serve dcp` over
loopback, in mutations/s, beside a bare client in the same run that does the same handshake
and only drains bytes (it walks frame lengths to know when every stream has ended, and
sends buffer acks). Also with --compress, and with --oso against the same stream of one
collection without it (rates as ratios of the plain runs in the same process).

    BENCH_ITEMS=1000000 .venv/bin/python tests/bench/bench_stream.py

Target (issue 3): at least 200,000 mutations/s of ~128-byte frames as JSON lines."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import time

ITEMS = int(os.environ.get("BENCH_ITEMS", "1000000"))
VBUCKETS = 64
BUFFER = 20 * 1024 * 1024
import _repo  # noqa: F401,E402  (the repository root on sys.path: tests/bench/_repo.py)

from tests.support.paths import DCPTOOL  # noqa: E402


def start_server(*extra: str):
    proc = subprocess.Popen([DCPTOOL, "serve", "dcp", "--port", "0", "--items", str(ITEMS), "--vbuckets", str(VBUCKETS),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    addr = json.loads(proc.stdout.readline())["listening"]
    host, port = addr.rsplit(":", 1)
    return proc, host, int(port)


def bare_client(host: str, port: int) -> tuple[float, int, int]:
    """Same handshake as dcptool stream (no SASL), then drain: (seconds, mutations, bytes)."""
    from dcptool.protocol.dcp.wire import messages as M
    hdr = struct.Struct(">BBHBBHI")
    t0 = time.perf_counter()
    s = socket.create_connection((host, port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    reqs = [M.Hello(opaque=1, agent=b"bare", features=(7, 8, 11, 10, 12, 3)), M.SelectBucket(opaque=2, bucket=b"default"),
            M.DcpOpen(opaque=3, name=b"bare", flags=0x21)]
    for i, (k, v) in enumerate([("connection_buffer_size", str(BUFFER)), ("set_noop_interval", "30"),
                                ("enable_noop", "true"), ("send_stream_end_on_client_close_stream", "true"),
                                ("enable_expiry_opcode", "true")]):
        reqs.append(M.Control(opaque=10 + i, key=k.encode(), value=v.encode()))
    reqs += [M.StreamRequest(opaque=100 + vb, vbucket=vb, flags=0x04) for vb in range(VBUCKETS)]
    s.sendall(b"".join(M.encode(r) for r in reqs))
    buf = bytearray(8 * 1024 * 1024)
    mv = memoryview(buf)
    end = 0
    ends = mutations = total = unacked = 0
    while ends < VBUCKETS:
        n = s.recv_into(mv[end:])
        if not n:
            raise RuntimeError("server closed")
        end += n
        total += n
        pos = 0
        while pos + 24 <= end:   # length walk only
            magic, op, _, _, _, _, bl = hdr.unpack_from(buf, pos)
            if pos + 24 + bl > end:
                break
            if magic == 0x80:
                unacked += 24 + bl
                if op == 0x57:
                    mutations += 1
                elif op == 0x55:
                    ends += 1
            pos += 24 + bl
        buf[:end - pos] = buf[pos:end]
        end -= pos
        if unacked >= BUFFER // 2:
            s.sendall(M.encode(M.BufferAck(bytes_acked=unacked)))
            unacked = 0
    s.close()
    return time.perf_counter() - t0, mutations, total


def dcptool_stream(host: str, port: int, *extra: str) -> tuple[float, float, int]:
    """(wall seconds including interpreter start, session seconds from the summary, mutations)."""
    t0 = time.perf_counter()
    with open(os.devnull, "wb") as devnull:
        out = subprocess.run([DCPTOOL, "stream", f"couchbase://{host}:{port}/default", "--format", "jsonl",
                              "--name", "bench", *extra], stdout=devnull, stderr=subprocess.PIPE, text=True,
                             timeout=600)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    # the summary line (docs/CLI.md "Summaries"): `summary: key=value ...`
    fields = dict(re.findall(r"(\w+)=(\S+)", out.stderr.split("summary:", 1)[-1]))
    if "items" not in fields or "seconds" not in fields:
        raise RuntimeError(f"no summary line in stderr: {out.stderr[-500:]}")
    return wall, float(fields["seconds"]), int(fields["items"])


def main() -> None:
    proc, host, port = start_server()
    try:
        bare_s, bare_n, bare_bytes = bare_client(host, port)
        wall, session_s, n = dcptool_stream(host, port)
        # issue 13: the first --compress run includes the producer compressing every value
        # once (then kept per vbucket); the second is the consumer's own rate
        _, compress_first, _ = dcptool_stream(host, port, "--compress")
        _, compress_s, compress_n = dcptool_stream(host, port, "--compress")
        bare_s2, _, _ = bare_client(host, port)
    finally:
        proc.terminate()
        proc.wait(30)
    # issue 13: --oso applies to a stream of one collection, so both runs here stream
    # inventory.airline (half the documents) from a server with that collection
    proc, host, port = start_server("--scopes", "1", "--collections-per-scope", "1")
    try:
        one = ("--collection", "inventory.airline")
        _, coll_s, coll_n = dcptool_stream(host, port, *one)
        _, oso_s, oso_n = dcptool_stream(host, port, *one, "--oso")
    finally:
        proc.terminate()
        proc.wait(30)
    bare_best = min(bare_s, bare_s2)
    assert bare_n == n == ITEMS, (bare_n, n)
    print(f"items {ITEMS}, vbuckets {VBUCKETS}, frame {bare_bytes / ITEMS:.0f} B/mutation on the wire")
    print(f"bare client (handshake + drain):  {bare_n / bare_best:12,.0f} mutations/s  "
          f"({bare_bytes / bare_best / 1e6:,.0f} MB/s, {bare_best:.2f} s)")
    print(f"dcptool stream --format jsonl:    {n / session_s:12,.0f} mutations/s  (session {session_s:.2f} s)")
    print(f"  same, wall clock incl. start-up: {n / wall:12,.0f} mutations/s  ({wall:.2f} s)")
    assert compress_n == n, (compress_n, n)
    print(f"dcptool stream --compress:        {n / compress_s:12,.0f} mutations/s  (session {compress_s:.2f} s; "
          f"{session_s / compress_s:.2f} x the plain run; first run, the producer compressing too: "
          f"{session_s / compress_first:.2f} x)")
    assert oso_n == coll_n > 0, (oso_n, coll_n)
    print(f"dcptool stream --collection C:    {coll_n / coll_s:12,.0f} mutations/s  (session {coll_s:.2f} s, "
          f"{coll_n} of the items)")
    print(f"dcptool stream --collection C --oso: {oso_n / oso_s:9,.0f} mutations/s  (session {oso_s:.2f} s; "
          f"{coll_s / oso_s:.2f} x the same stream without --oso)")
    print(f"ratio stream/bare: {bare_best / session_s:.2f}   target 200,000/s: "
          f"{'met' if n / session_s >= 200_000 else 'NOT met'}")


if __name__ == "__main__":
    main()
