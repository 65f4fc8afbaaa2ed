"""dcptool.replay: captures at rest and everything that reads or writes them.

    from dcptool.replay import replay

    result = replay("caps/", tables=["documents"])
    print(result.tables["documents"].num_rows)

`replay()` (replay/run.py) is the library call under `dcptool replay`: the engines
(replay/local/, replay/spark/), the capture store (replay/store/), the rules both engines share
(replay/rules/) and the checks (replay/check/) sit behind it. Importing this package loads
none of them (nor pyarrow or numpy); modules inside it import each other by their full
names, never through this package."""

from dcptool.replay.run import (
    ApplyFailed,
    ApplyLoadError,
    Hooks,
    ReplayResult,
    RequestError,
    Spark,
    replay,
)

__all__ = ["replay", "Spark", "Hooks", "ReplayResult", "RequestError", "ApplyLoadError", "ApplyFailed"]
