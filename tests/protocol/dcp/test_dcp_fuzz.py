"""Fuzzing the DCP parser: random and mutated frames never raise anything but our coded
protocol errors, and a hostile length never drives an allocation."""

from __future__ import annotations

import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcptool.protocol.dcp.wire import columnar
from dcptool.protocol.dcp.wire import messages as M
from dcptool.protocol.dcp.wire.frames import FrameParser, split_until_error
from dcptool.protocol.errors import ProtocolError
from tests.support.dcp_vectors import VECTORS

GOLDEN = [v[1] for v in VECTORS]
CAP = 64 * 1024


def _parse_all(data: bytes, chunk: int):
    parser = FrameParser(max_body=CAP)
    frames = []
    try:
        for i in range(0, len(data), chunk):
            frames += parser.feed(data[i:i + chunk])
    except ProtocolError as exc:
        assert exc.code is not None
        frames += getattr(exc, "frames", [])
    for f in frames:
        msg = M.decode(f, collections=True)   # never raises
        M.to_row(msg)
        if getattr(msg, "decode_error", None) is None:
            assert M.encode(msg) == f.raw
    try:
        o, ln, _, _ = columnar.scan(data, CAP)
        rows = columnar.to_rows(columnar.decode_batch(data, o, ln, collections=True))
        assert len(rows) == len(o)
    except ProtocolError as exc:  # pragma: no cover - scan returns errors, never raises
        raise AssertionError(exc)
    return frames


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400), st.integers(min_value=1, max_value=64))
def test_random_bytes(data, chunk):
    _parse_all(data, chunk)


@st.composite
def mutated(draw):
    frames = [draw(st.sampled_from(GOLDEN)) for _ in range(draw(st.integers(1, 4)))]
    return _damaged(draw, bytearray(b"".join(frames)), 6)


def _damaged(draw, data: bytearray, edits: int) -> bytes:
    """`data` with up to `edits` bytes overwritten, then maybe cut short."""
    for _ in range(draw(st.integers(0, edits))):
        pos = draw(st.integers(0, len(data) - 1))
        data[pos] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    return bytes(data)


@settings(max_examples=600, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutated(), st.integers(min_value=1, max_value=50))
def test_mutated_golden_frames(data, chunk):
    _parse_all(data, chunk)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(min_value=CAP + 1, max_value=2**32 - 1), st.sampled_from(GOLDEN))
def test_hostile_lengths_allocate_nothing(body_len, frame):
    data = bytearray(frame)
    data[8:12] = body_len.to_bytes(4, "big")
    tracemalloc.start()
    try:
        _parse_all(bytes(data) + bytes(100), 7)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


@st.composite
def runs(draw):
    """Long runs of equal-length frames (what a backfill looks like, and what the scan
    compares column-wise), other frames in between, then a few damaged bytes or a cut."""
    data = bytearray()
    for _ in range(draw(st.integers(1, 4))):
        frame = draw(st.sampled_from(GOLDEN))
        data += frame * draw(st.integers(1, 120))
    return _damaged(draw, data, 3)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_scan_of_runs_agrees_with_the_frame_splitter(data):
    bounds, consumed, err = split_until_error(data, CAP)
    o, ln, consumed2, err2 = columnar.scan(data, CAP)
    assert [(int(a), int(b)) for a, b in zip(o, ln)] == bounds
    assert consumed2 == consumed
    if err2 is None and err is not None:
        # the splitter also judges the header of an incomplete last frame; the scan waits
        # for the rest of it
        tail = data[consumed:]
        assert len(tail) >= 24 and 24 + int.from_bytes(tail[8:12], "big") > len(tail)
    else:
        assert (err2.code if err2 else None) == (err.code if err else None)
