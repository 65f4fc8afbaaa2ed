"""`dcptool capture couchbase://...`: the capture itself is library (capture/dcp_capture.py); this
shows its progress and events on stderr and prints its summary."""

from __future__ import annotations

from dcptool.capture.dcp_capture import capture_dcp
from dcptool.capture.options import CaptureSettings, LiveOptions
from dcptool.capture.run import StopSignals
from dcptool.cli.runners.dcp_live import EventLog
from dcptool.cli.view.console import err_console
from dcptool.cli.view.progress import make_progress, print_summary


def run_capture(opts: LiveOptions, settings: CaptureSettings) -> None:

    def note(text: str) -> None:
        err_console().print(text, highlight=False)

    # SIGINT (even when inherited ignored), SIGTERM, SIGHUP: the same clean finish as Ctrl-C
    with StopSignals() as signals:
        result = capture_dcp(opts, settings, progress=lambda: make_progress("dcp", quiet=settings.quiet),
                             tell=EventLog(quiet=settings.quiet), note=note, signals=signals)
        if result.wrote:
            print_summary(result.files, json_summary=settings.json_summary, quiet=settings.quiet,
                          extra=result.summary())
    if result.error is not None:
        raise result.error
