"""Process-wide settings a replay (or a capture) makes before numpy and pyarrow load: pandas
kept out, and freed memory kept for reuse. The command line makes them (`dcptool replay`,
`dcptool capture`); the library call (replay/run.py) does not, as they change the whole
process of the program that calls it."""

from __future__ import annotations

import ctypes
import os
import sys


class _NoPandas:
    """An import finder that says pandas is not installed."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError("pandas is not loaded by this dcptool command", name=name)
        return None


def without_pandas() -> None:
    """Keep pandas out of this process. pyarrow imports it the first time it converts a
    numpy array, only to check that the array is no pandas object; `capture` and the
    in-process `replay` never have one, and the import costs 0.15-0.17 s and 52 MiB.
    pyarrow then treats pandas as missing for the rest of the process."""
    if "pandas" not in sys.modules and _NoPandas not in sys.meta_path:
        sys.meta_path.insert(0, _NoPandas)


def tune_for_replay(in_process: bool) -> None:
    """Process settings for the in-process engine, made before numpy and pyarrow load.

    The engine allocates and frees arrays of a few MB per chunk. By default glibc hands each
    back to the kernel and faults it in again as zeroed (huge) pages, which cost a fifth of
    the CPU time at 10M frames (perf: clear_page_erms); mimalloc, pyarrow's allocator, purges
    likewise. Freed memory is kept for reuse instead (peak RSS is unchanged: it is a peak).
    The in-process engine does not load pandas (a sixth of a 1M-frame replay)."""
    if in_process:
        without_pandas()
    os.environ.setdefault("MIMALLOC_PURGE_DELAY", "-1")
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 << 20)   # M_MMAP_THRESHOLD: its largest value
        libc.mallopt(-1, 1 << 30)    # M_TRIM_THRESHOLD
        libc.mallopt(-8, 1)          # M_ARENA_MAX: threads share one heap (and its free memory)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass
