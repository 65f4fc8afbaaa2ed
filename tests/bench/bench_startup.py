"""Benchmark: `dcptool --help` start-up time beside `python -c "import click"` (the baseline,
same interpreter, same run). Target (issue 2): under 3x the baseline."""

from __future__ import annotations

import os
import subprocess
import sys
import time

RUNS = int(os.environ.get("BENCH_RUNS", "15"))
import _repo  # noqa: F401,E402  (the repository root on sys.path: tests/bench/_repo.py)

from tests.support.paths import DCPTOOL  # noqa: E402


def best(cmd) -> float:
    times = []
    for _ in range(RUNS):
        t = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    base = best([sys.executable, "-c", "import click"])
    for name, cmd in (("dcptool --help", [DCPTOOL, "--help"]), ("dcptool --version", [DCPTOOL, "--version"]),
                      ("dcptool decode --help", [DCPTOOL, "decode", "--help"])):
        t = best(cmd)
        print(f"{name:24s} {t * 1000:7.1f} ms   {t / base:5.2f}x  python -c 'import click' ({base * 1000:.1f} ms)")


if __name__ == "__main__":
    main()
