"""`RowGroupEncoder`: the thread that encodes and compresses Parquet row groups for a capture
writer, so that the writer thread (conforming batches, the in-progress IPC copy, filling the
next row group) and the network loop keep the other core busy while zstd or LZ4 runs here
(pyarrow releases the GIL while it encodes).

One thread per writer, shared by its segments in turn: jobs run one at a time in the order
they were handed over, so row groups reach each file in `frame_no` order and the last row
group of a rotated segment is encoded before the first of the next one. The queue is bounded
in row groups (`max_outstanding`, counting the one being encoded): a hand-off that finds it
full waits, which is what bounds memory, and is counted in `stalls`."""

from __future__ import annotations

import collections
import concurrent.futures
import threading

# Row groups handed over and not yet in their file, the one being encoded included. Two keep
# the encoder fed while the writer thread is busy with the next hand-off; together with the
# row group filling that is three row groups (3 x ROW_GROUP_BYTES) at most.
ENCODER_QUEUE_ROW_GROUPS = 2


class RowGroupEncoder:
    def __init__(self, max_outstanding: int = ENCODER_QUEUE_ROW_GROUPS, name: str = "dcptool-parquet"):
        if max_outstanding < 1:
            raise ValueError("max_outstanding must be at least 1")
        self.max_outstanding = int(max_outstanding)
        self.stalls = 0            # hand-offs that had to wait for room
        self.peak_outstanding = 0  # most row groups handed over and not yet done, at any time
        self.done = 0              # jobs finished (with or without an error)
        self._jobs: collections.deque = collections.deque()
        self._outstanding = 0
        self._cv = threading.Condition()
        self._closed = False
        self._name = name
        self._thread: threading.Thread | None = None

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Queue fn(*args) behind the jobs already handed over; waits while the queue is full.
        The returned future holds fn's result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("row group encoder is closed")
            if self._outstanding >= self.max_outstanding:
                self.stalls += 1
                self._cv.notify_all()      # whoever watches the counter
                self._cv.wait_for(lambda: self._outstanding < self.max_outstanding)
            self._jobs.append((fut, fn, args))
            self._outstanding += 1
            self.peak_outstanding = max(self.peak_outstanding, self._outstanding)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return fut

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                fut, fn, args = self._jobs.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                    fut.set_exception(exc)
            # the row group is in its file: its batches (and the receive buffers under them)
            # go now, not when the next job comes
            fut = fn = args = None
            with self._cv:
                self._outstanding -= 1
                self.done += 1
                self._cv.notify_all()

    def close(self) -> None:
        """Run what was handed over, then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
