"""Benchmark: split and decode one million ~128-byte DCP mutation frames.

Prints frames/s and MB/s for (a) a bare loop that only reads each length field (the
baseline, same buffer, same run), (b) boundary scan + columnar decode, (c) the same to an
Arrow record batch (best of 3 runs each), and (d) `dcptool decode --format jsonl > /dev/null` end to end."""

from __future__ import annotations

import os
import struct
import subprocess
import tempfile
import time

import _repo  # noqa: F401,E402  (the repository root on sys.path: tests/bench/_repo.py)

from tests.support.paths import DCPTOOL  # noqa: E402

N = int(os.environ.get("BENCH_FRAMES", "1000000"))


def make_buffer(n: int) -> bytes:
    from dcptool.protocol.dcp.wire import messages as M
    block = []
    for i in range(1000):
        block.append(M.encode(M.Mutation(vbucket=i % 64, opaque=0x10000 + i % 64, cas=1_700_000_000_000 + i,
                                         key=b"doc-%08d" % i, value=b'{"n":%06d,"pad":"%s"}' % (i, b"x" * 38),
                                         datatype=1, by_seqno=i + 1, rev_seqno=1)))
    blob = b"".join(block)
    return blob * (n // 1000)


def bare_lengths(buf: bytes) -> int:
    unpack = struct.Struct(">I").unpack_from
    pos, n, count = 0, len(buf), 0
    while pos + 24 <= n:
        pos += 24 + unpack(buf, pos + 8)[0]
        count += 1
    return count


def timed(fn, *a, repeat: int = 3):
    """fn's result and its best time of `repeat` runs (a single run is at the mercy of
    first-touch page faults and of whatever else this machine runs)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn(*a)
        best = min(best, time.perf_counter() - t)
    return out, best


def main():
    from dcptool.protocol.dcp.wire import columnar
    from dcptool.replay.store.dcp_batch import frames_to_record_batch

    buf = make_buffer(N)
    mb = len(buf) / 1e6
    print(f"{N} frames, {mb:.1f} MB, {len(buf) / N:.0f} bytes/frame")
    count, base = timed(bare_lengths, buf)
    assert count == N

    def scan_decode():
        o, ln, _, _ = columnar.scan(buf)
        return columnar.decode_batch(buf, o, ln)

    _, t_dec = timed(scan_decode)
    (rb, _, _), t_arrow = timed(frames_to_record_batch, buf)
    assert rb.num_rows == N
    with tempfile.NamedTemporaryFile(suffix=".bin") as fh:
        fh.write(buf)
        fh.flush()
        t = time.perf_counter()
        with open(os.devnull, "wb") as null:
            subprocess.run([DCPTOOL, "decode", "--format", "jsonl", fh.name], stdout=null, check=True)
        t_json = time.perf_counter() - t

    def line(name, secs):
        print(f"{name:38s} {N / secs:>12,.0f} frames/s {mb / secs:>8.1f} MB/s   {secs / base:5.2f}x baseline time")

    line("baseline: bare length-field loop", base)
    line("scan + columnar decode", t_dec)
    line("scan + decode + Arrow record batch", t_arrow)
    line("dcptool decode --format jsonl", t_json)


if __name__ == "__main__":
    main()
