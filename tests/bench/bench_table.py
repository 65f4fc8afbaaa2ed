"""Benchmark: `dcptool replay --table frames` of a generated DCP capture printed as a table
versus as JSON lines, for about 10k rows, written to a file and to a pseudo-terminal.

    .venv/bin/python tests/bench/bench_table.py            # ~10k rows
    .venv/bin/python tests/bench/bench_table.py 20000      # about this many rows
    PYTHONPATH=/tmp/old-tree .venv/bin/python tests/bench/bench_table.py   # another tree

Prints the wall time of each run (a fresh `python -m dcptool.cli` process each, start-up
included) and the table / jsonl ratio. The pseudo-terminal is 200 columns wide (a wide
terminal, where rich tables used to wrap badly and slowly).
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import tempfile
import threading
import time

import _repo  # noqa: F401,E402  (the repository root on sys.path: tests/bench/_repo.py)

from tests.support import capgen  # noqa: E402


def _capture(directory: str, rows: int) -> int:
    import pyarrow.parquet as pq
    n_events = max(50, rows // 4)
    for _ in range(8):  # find the generator size that gives about `rows` frames
        paths = capgen.write_captures(capgen.generate("dcp", 7, n_events=n_events, max_captures=1),
                                      directory, seed=7, max_segments=1)
        got = sum(pq.ParquetFile(p).metadata.num_rows for p in paths)
        if abs(got - rows) <= rows * 0.1:
            return got
        for p in paths:
            os.unlink(p)
        n_events = max(50, int(n_events * rows / max(got, 1)))
    return got


def _cmd(directory: str, fmt: str) -> list[str]:
    return [sys.executable, "-m", "dcptool.cli", "replay", directory, "--table", "frames", "--format", fmt]


def _to_file(directory: str, fmt: str) -> tuple[float, int]:
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        subprocess.run(_cmd(directory, fmt), stdout=out, stderr=subprocess.DEVNULL, check=True, timeout=600)
        dt = time.perf_counter() - t0
        return dt, out.tell()


def _to_pty(directory: str, fmt: str, cols: int = 200) -> tuple[float, int]:
    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
    got = [0]

    def drain():
        while True:
            try:
                b = os.read(master, 1 << 16)
            except OSError:
                return
            if not b:
                return
            got[0] += len(b)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    t0 = time.perf_counter()
    subprocess.run(_cmd(directory, fmt), stdout=slave, stderr=subprocess.DEVNULL, check=True, timeout=600,
                   env=env)
    dt = time.perf_counter() - t0
    os.close(slave)
    t.join(timeout=10)
    os.close(master)
    return dt, got[0]


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    with tempfile.TemporaryDirectory() as d:
        n = _capture(d, rows)
        print(f"frames table: {n} rows")
        jf, jb = _to_file(d, "jsonl")
        tf, tb = _to_file(d, "table")
        tp, pb = _to_pty(d, "table")
        print(f"jsonl to a file:           {jf:7.2f} s  {jb / 1e6:6.1f} MB")
        print(f"table to a file:           {tf:7.2f} s  {tb / 1e6:6.1f} MB   table/jsonl {tf / jf:5.2f}")
        print(f"table to a 200-col pty:    {tp:7.2f} s  {pb / 1e6:6.1f} MB   table/jsonl {tp / jf:5.2f}")


if __name__ == "__main__":
    main()
