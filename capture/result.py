"""What a capture returns: the segments it finished, its summary and the error that ended
it (raised by the caller after it reported the summary)."""

from __future__ import annotations

import dataclasses

from dcptool.capture.run import RunStats


@dataclasses.dataclass
class CaptureResult:
    files: list              # the finished segments, as replay/store/writer.py lists them
    stats: RunStats          # the common counters of the run
    fields: dict             # the protocol's summary fields, after the common ones
    error: BaseException | None = None   # what ended the run (Interrupted for a signal), or None
    wrote: bool = True       # worth a summary: segments were finished, or nothing went wrong
    gaps: int = 0            # Synapse: POSITION gaps seen

    def summary(self) -> dict:
        """The summary (CLI.md): the common fields (capture/run.py), then the protocol's."""
        return {**self.stats.summary(self.error), **self.fields}
