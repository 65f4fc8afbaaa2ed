"""Process-wide settings that a capture makes before numpy and pyarrow load (pandas kept out:
replay/tuning.py, shared with `replay`)."""

from __future__ import annotations

from dcptool.replay.tuning import without_pandas

__all__ = ["without_pandas", "fewer_gc_passes"]


def fewer_gc_passes() -> None:
    """For a long-running hot loop: what start-up allocated is never collected again, and
    the cyclic collector runs every 50,000 new objects instead of every 700 (the loop's
    objects are short-lived and acyclic; the passes showed as 3% of a capture's CPU)."""
    import gc
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
