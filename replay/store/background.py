"""`BackgroundWriter`: a CaptureWriter on its own thread behind a queue bounded in bytes, so
that Parquet encoding never runs on the network loop, and a failing disk stops the capture
through `on_error` instead of leaving the consumer paused."""

from __future__ import annotations

import collections
import threading

from dcptool.replay.store.writer import CaptureWriter


class BackgroundWriter:
    """Runs a CaptureWriter on its own thread behind a queue bounded in bytes.

    `submit` never drops a batch. By default it never blocks either: the network side
    watches `backlog_bytes` and stops acknowledging (DCP buffer acks) or reading once it is
    above `max_queue_bytes`, which slows the producer down. `submit(block=True)` waits for
    room instead. A disk error stops the thread; it is kept in `error` and raised by the
    next `submit` and by `close`.
    """

    def __init__(self, writer: CaptureWriter, max_queue_bytes=64 * 2**20, on_error=None):
        self.writer = writer
        # called (on the writer thread) once, when a disk error stops it: the network side
        # may be paused on the backlog and would otherwise never look at `error` again
        self.on_error = on_error
        self.max_queue_bytes = int(max_queue_bytes)
        self.error: BaseException | None = None
        self._queue: collections.deque = collections.deque()
        self._backlog = 0
        self._cv = threading.Condition()
        self._closing = False
        self._inflight = 0
        self._tick = max(0.05, writer.flush_interval / 4)
        self._thread = threading.Thread(target=self._run, name="dcptool-capture-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def backlog_bytes(self) -> int:
        return self._backlog

    @property
    def queue_depth(self) -> int:
        """Batches submitted and not yet written (--metrics: dcptool_writer_queue_depth)."""
        return len(self._queue) + self._inflight

    @property
    def congested(self) -> bool:
        return self._backlog >= self.max_queue_bytes

    def submit(self, batch, *, block: bool = False, timeout: float | None = None) -> None:
        if self.error is not None:
            raise self.error
        if self._closing:
            raise ValueError("background writer is closed")
        size = batch.nbytes
        with self._cv:
            if block:
                self._cv.wait_for(lambda: self._backlog < self.max_queue_bytes
                                  or self.error is not None, timeout=timeout)
                if self.error is not None:
                    raise self.error
            self._queue.append((batch, size))
            self._backlog += size
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far has been handed to the writer."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and self._inflight == 0
                                     or self.error is not None, timeout=timeout)

    def _run(self) -> None:
        w = self.writer
        try:
            while True:
                with self._cv:
                    if not self._queue and not self._closing:
                        self._cv.wait(timeout=self._tick)
                    items = list(self._queue)
                    self._queue.clear()
                    self._inflight = len(items)
                    stop = self._closing and not items
                for batch, size in items:
                    w.write(batch)
                    with self._cv:
                        self._backlog -= size
                        self._inflight -= 1
                        self._cv.notify_all()
                if stop:
                    return
                w.tick()
        except BaseException as exc:  # noqa: BLE001 - handed to the network side
            with self._cv:
                self.error = exc
                self._cv.notify_all()
            if self.on_error is not None:
                try:
                    self.on_error(exc)
                except Exception:  # noqa: BLE001 - the error itself is what gets reported
                    pass

    def close(self) -> list[dict]:
        """Write everything queued, finish the segment, return the finished segments."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        if self.error is not None:
            try:
                self.writer.close()
            except BaseException:  # noqa: BLE001 - the first error is the one to report
                pass
            raise self.error
        return self.writer.close()
