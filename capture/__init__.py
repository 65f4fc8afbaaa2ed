"""dcptool.capture: capturing a source into a directory, without the CLI.

    from dcptool.capture import CaptureSettings, LiveOptions, capture, parse_source

    opts = LiveOptions(source=parse_source("couchbase://127.0.0.1/default"), user="admin",
                       password=..., name="my-capture")
    result = capture(opts, CaptureSettings(output="caps"))
    print(result.summary(), result.files)
    if result.error: raise result.error

`capture()` runs the protocol's transport (protocol/transport/) and writes every frame or
line through the capture store (replay/store/), then returns a CaptureResult; callbacks
show progress and events. capture/dcp_capture.py and capture/synapse_capture.py hold each protocol's run,
capture/run.py what both share (summary counters, signals, the event loop). This package
imports protocol/ and replay/store/, never cli/, click or rich; `dcptool capture` (cli/)
only parses options, calls it and prints.
"""

from __future__ import annotations

from dcptool.capture.lock import hold
from dcptool.capture.options import CaptureSettings, LiveOptions
from dcptool.capture.sources import Source, parse_source

# Lazy imports: only where start-up time needs them. Importing dcptool.capture (its options,
# as cli/ does for `stream`) loads no numpy or pyarrow: each protocol's run loads when called.

# `hold(directory, shard=)`: one writer per capture directory and shard (capture/lock.py); the
# CLI holds it around a run, from --resume's recovery to the end-of-run merge.
__all__ = ["CaptureSettings", "LiveOptions", "Source", "parse_source", "capture", "hold"]


def capture(opts: LiveOptions, settings: CaptureSettings, **callbacks):
    """Capture the source of `opts` into settings.output (capture/dcp_capture.py capture_dcp or
    capture/synapse_capture.py capture_synapse, by the source's protocol); returns a CaptureResult."""
    if opts.source.protocol == "dcp":
        from dcptool.capture.dcp_capture import capture_dcp
        return capture_dcp(opts, settings, **callbacks)
    from dcptool.capture.synapse_capture import capture_synapse
    return capture_synapse(opts, settings, **callbacks)
