"""`dcptool verify`: checks captures for completeness and protocol correctness, in one pass
in bounded memory, and returns findings (no click, no exit codes: cli/verify.py prints them).

This module owns the findings, the capture files (which files exist, whether their names,
metadata, segment chain and frame numbers agree, whether they can be read) and the pass
over the rows, in replay order (started_at of the capture, capture_id, frame_no), Parquet
row group by row group with only the columns the checks need. The protocol checks are in
verify_dcp.py and verify_synapse.py.

A damaged file is verified as far as it can be read; damage is reported before every other
finding. Findings are kept up to a limit per check (the count goes on), so memory does not
grow with a capture that is wrong everywhere."""

from __future__ import annotations

import bisect
import os
import re
import time
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dcptool.replay.check.findings import (
    Finding,
    Findings,
    MixedProtocols,
    Report,
    VerifyError,
    Where,
)
from dcptool.replay.check.verify_dcp import DcpChecker, check_shards
from dcptool.replay.check.verify_synapse import SynapseChecker
from dcptool.replay.store import reader, retained
from dcptool.replay.store.files import arrow_source, shown
from dcptool.replay.store.in_progress import DAMAGED_SUFFIX, InProgress, held_by_writer
from dcptool.replay.store.naming import (
    IN_PROGRESS_SUFFIX,
    TMP_SUFFIX,
    merged_name,
    segment_name,
)
from dcptool.replay.store.resume import display_identity, same_origin
from dcptool.replay.store.schema import META_SOURCE, META_SOURCE_ID, capture_schema

FINISHED_SUFFIX = ".parquet"
BATCH_ROWS = 1 << 18


# ------------------------------------------------------------------------------ files

# group 4: the (first) segment number; a merged segment's name adds `-{last:06d}`
_NAME_RE = re.compile(r"^(dcp|synapse)-(\d{8}T\d{6}\.\d{6}Z)-([0-9a-fA-F]{8})-(\d{6})(?:-\d{6})?\.(parquet|arrows)$")


def _candidates(paths: list[str], out: Findings) -> list[tuple[str, bool]]:
    """(path, may skip) of every file to verify: may skip when it is in a directory and not
    named as a segment (a foreign file there is skipped with a warning, as replay does)."""
    found: list[tuple[str, bool]] = []
    for p in paths:
        if os.path.isdir(p):
            for name in sorted(os.listdir(p)):
                full = os.path.join(p, name)
                if name.startswith(".") or not os.path.isfile(full):
                    continue
                if name.endswith((FINISHED_SUFFIX, IN_PROGRESS_SUFFIX)):
                    found.append((full, not _NAME_RE.match(name)))
                elif name.endswith(FINISHED_SUFFIX + TMP_SUFFIX):
                    done = full[:-len(TMP_SUFFIX)]
                    if os.path.exists(done):
                        out.add(Finding("file.leftover", f"temporary file left next to the finished segment "
                                        f"{shown(os.path.basename(done))}", file=shown(full)))
                elif IN_PROGRESS_SUFFIX + DAMAGED_SUFFIX in name:
                    _kept_aside(full, out)
        elif os.path.isfile(p):
            found.append((p, False))
        else:
            raise VerifyError(f"{shown(p)}: no such file or directory")
    seen, unique = set(), []
    for f, may_skip in found:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            unique.append((f, may_skip))
    return unique


def _kept_aside(path: str, out: Findings) -> None:
    """A damaged in-progress file `capture --resume` kept aside: what of it can be read."""
    ip = InProgress(path)
    for _ in ip:
        pass
    m = _NAME_RE.match(os.path.basename(path).split(DAMAGED_SUFFIX)[0])
    out.add(Finding("file.damaged", f"damaged in-progress segment kept aside: {ip.rows:,} rows in "
                    f"{ip.batches:,} whole batches readable (recovered into the segment's .parquet by "
                    f"`capture --resume`), {ip.unread:,} bytes after byte {ip.good_end:,} not"
                    + (f" ({ip.error})" if ip.error else ""),
                    file=shown(path), segment=int(m.group(4)) if m else None))


def _describe_all(paths: list[tuple[str, bool]], out: Findings) -> tuple[list[reader.CaptureFile], int, int]:
    """CaptureFiles of the readable candidates, unreadable ones (findings) and foreign files in
    a directory (skipped with a warning)."""
    files, bad, skipped = [], 0, 0
    reader.prefetch_footers([p for p, _ in paths if p.endswith(FINISHED_SUFFIX)])   # on a few threads
    for path, may_skip in paths:
        if path.endswith(IN_PROGRESS_SUFFIX) and os.path.getsize(path) == 0:
            out.add(Finding("file.in_progress", "in-progress segment with nothing written yet", file=shown(path)))
            continue
        m = _NAME_RE.match(os.path.basename(path))
        try:
            files.append(reader.describe(path))
        except reader.UnsupportedFormat as exc:
            bad += 1
            out.add(Finding("file.unsupported_format", _one_line(exc), file=shown(path),
                            segment=int(m.group(4)) if m else None))
        except reader.NotACapture as exc:
            if may_skip:
                reader.warn(f"{shown(path)}: not a dcptool capture segment, skipped")
                skipped += 1
                continue
            bad += 1
            out.add(Finding("file.unreadable", _one_line(exc), file=shown(path),
                            segment=int(m.group(4)) if m else None))
        except (reader.CaptureError, OSError) as exc:
            bad += 1
            out.add(Finding("file.unreadable", _one_line(exc), file=shown(path),
                            segment=int(m.group(4)) if m else None))
    return files, bad, skipped


def _check_sources(captures: list[list[reader.CaptureFile]], out: Findings) -> None:
    """A directory holds captures of one source: each capture of another source than the
    first one of its directory is a finding."""
    first: dict[str, tuple[str, reader.CaptureFile]] = {}
    for segs in captures:
        f = segs[0]
        where = os.path.dirname(os.path.realpath(f.path))
        source, sid = f.metadata.get(META_SOURCE, ""), f.metadata.get(META_SOURCE_ID, "")
        if where not in first:
            first[where] = (source, f)
            continue
        source0, f0 = first[where]
        sid0 = f0.metadata.get(META_SOURCE_ID, "")
        if not same_origin(source0, sid0, source, sid):   # the bucket (server name) where both say it
            out.add(Finding("file.mixed_sources", f"capture {f.capture_id} is of {display_identity(sid, source)}, "
                            f"capture {f0.capture_id} in the same directory of {display_identity(sid0, source0)}",
                            file=shown(f.path), segment=f.segment, capture_id=f.capture_id))


def _check_name(f: reader.CaptureFile, out: Findings) -> None:
    name = os.path.basename(f.path)
    m = _NAME_RE.match(name)
    if m is None:
        out.add(Finding("file.name_mismatch", f"file name {name!r} is not "
                        "{protocol}-{start}-{id8}-{segment:06d}.parquet|.arrows",
                        file=f.path, segment=f.segment, capture_id=f.capture_id))
        return
    started = reader.parse_started(f.started_at)
    want = (merged_name(f.protocol, started, f.capture_id, f.segment, f.last_segment)
            if f.last_segment > f.segment else segment_name(f.protocol, started, f.capture_id, f.segment))
    want = want[:-len(FINISHED_SUFFIX)] + "." + m.group(5)
    if name != want:
        parts = []
        if m.group(1) != f.protocol:
            parts.append(f"protocol {m.group(1)} vs {f.protocol}")
        if m.group(3).lower() != f.capture_id.replace("-", "")[:8].lower():
            parts.append(f"capture id {m.group(3)} vs {f.capture_id}")
        if int(m.group(4)) != f.segment:
            parts.append(f"segment {int(m.group(4))} vs {f.segment}")
        if not parts:
            parts.append(f"start {m.group(2)} vs {f.started_at}")
        out.add(Finding("file.name_mismatch", f"file name says {', '.join(parts)} (metadata)",
                        file=f.path, segment=f.segment, capture_id=f.capture_id))


def _group(files: list[reader.CaptureFile], out: Findings) -> list[list[reader.CaptureFile]]:
    """Captures in replay order, each its segments in order (one file per segment)."""
    by_seg: dict[tuple[str, int], reader.CaptureFile] = {}
    for f in reader.without_covered(files)[0]:   # parts a merged segment covers: not read
        key = (f.capture_id, f.segment)
        old = by_seg.get(key)
        if old is None:
            by_seg[key] = f
        elif old.in_progress != f.in_progress:
            keep, drop = (f, old) if old.in_progress else (old, f)
            by_seg[key] = keep
            out.add(Finding("file.leftover", f"in-progress copy of the finished segment "
                            f"{os.path.basename(keep.path)} (not read)", file=drop.path,
                            segment=drop.segment, capture_id=drop.capture_id))
        else:
            out.add(Finding("file.duplicate_segment", f"segment {f.segment} of capture {f.capture_id} "
                            f"is also in {old.path} (this one not read)", file=f.path,
                            segment=f.segment, capture_id=f.capture_id))
    caps: dict[str, list[reader.CaptureFile]] = {}
    for f in by_seg.values():
        caps.setdefault(f.capture_id, []).append(f)
    groups = []
    for cid, segs in caps.items():
        segs.sort(key=lambda f: f.segment)
        first = segs[0]
        for f in segs[1:]:
            if f.protocol != first.protocol or f.started_at != first.started_at:
                out.add(Finding("file.metadata_mismatch", f"segment {f.segment} says protocol "
                                f"{f.protocol} started {f.started_at}, segment {first.segment} "
                                f"{first.protocol} {first.started_at}", file=f.path,
                                segment=f.segment, capture_id=cid))
        groups.append(segs)
    groups.sort(key=lambda segs: (reader.parse_started(segs[0].started_at), segs[0].capture_id))
    return groups


# ------------------------------------------------------------------------------ rows

Chunk = tuple[pa.Table, Callable[[], pa.Array]]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _parquet_chunks(f: reader.CaptureFile, cols: list[str], where: Where, out: Findings,
                    batch_rows: int, lost: list) -> Iterator[Chunk]:
    schema = capture_schema(f.protocol)
    want = pa.schema([schema.field(c) for c in cols])
    try:
        pf = pq.ParquetFile(arrow_source(f.path), metadata=reader.footer(f.path), pre_buffer=False,
                             page_checksum_verification=True)
        md = pf.metadata
    except (OSError, pa.ArrowException) as exc:
        out.add(Finding("file.damaged", f"cannot open: {_one_line(exc)}", file=f.path,
                        segment=f.segment, capture_id=f.capture_id))
        lost.append(None)
        return
    present = set(pf.schema_arrow.names)
    read_cols = [c for c in want.names if c in present]
    fn_col = pf.schema_arrow.get_field_index("frame_no")
    for rg in range(md.num_row_groups):
        offset = 0
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[rg], columns=read_cols,
                                         use_threads=True):
                t = reader.conform(pa.Table.from_batches([batch]), want)
                yield t, _raw_loader(pf, rg, offset, batch.num_rows)
                offset += batch.num_rows
        except (OSError, pa.ArrowException) as exc:
            rng = _stats_range(md, rg, fn_col)
            what = f"frames {rng[0]}..{rng[1]}" if rng else "its frames"
            out.at(where, "file.damaged", f"row group {rg} unreadable after {offset} rows ({what} "
                   f"not verified): {_one_line(exc)}", frame_no=rng[0] if rng else None)
            lost.append(rng)


def _stats_range(md, rg: int, col: int) -> tuple[int, int] | None:
    if col < 0:
        return None
    try:
        st = md.row_group(rg).column(col).statistics
        if st is not None and st.has_min_max:
            return int(st.min), int(st.max)
    except (OSError, pa.ArrowException, ValueError):
        pass
    return None


def _raw_loader(pf: pq.ParquetFile, rg: int, offset: int, n: int) -> Callable[[], pa.Array]:
    def load() -> pa.Array:
        return pf.read_row_group(rg, columns=["raw"]).column("raw").slice(offset, n).combine_chunks()
    return load


def _given(raw: pa.Array) -> Callable[[], pa.Array]:
    """A chunk's `raw` loader when the column is already read."""
    return lambda: raw


def _arrows_chunks(f: reader.CaptureFile, cols: list[str], where: Where, out: Findings) -> Iterator[Chunk]:
    schema = capture_schema(f.protocol)
    want = pa.schema([schema.field(c) for c in cols])
    ip = InProgress(f.path)
    for batch in ip:
        t = pa.Table.from_batches([batch])
        raw = t.column("raw").combine_chunks() if "raw" in t.column_names else pa.nulls(t.num_rows, pa.binary())
        yield reader.conform(t, want), _given(raw)
    damage, tail = ip.damage(), ip.tail()
    if damage and not held_by_writer(f.path):
        out.at(where, "file.damaged", f"in-progress segment: {damage}; `capture --resume` recovers the "
               "whole batches and keeps the file aside")
    elif tail and not held_by_writer(f.path):
        out.at(where, "file.torn_tail", f"in-progress segment: {tail}; `capture --resume` truncates it there")


class _Frames:
    """frame_no continuity of one capture across its segments."""

    def __init__(self, out: Findings):
        self.out = out
        self.next: int | None = 0

    def unknown(self) -> None:
        self.next = None

    def skip_to(self, frame: int) -> None:
        self.next = frame

    def feed(self, fn: np.ndarray, where: Where) -> bool:
        """True when the rows follow on without a hole."""
        if not len(fn):
            return True
        ok = True
        if self.next is not None and fn[0] != self.next:
            ok = False
            self._report(self.next - 1, int(fn[0]), where)
        d = np.diff(fn)
        for i in np.flatnonzero(d != 1).tolist():
            ok = False
            self._report(int(fn[i]), int(fn[i + 1]), where)
        self.next = int(fn[-1]) + 1
        return ok

    def _report(self, before: int, after: int, where: Where) -> None:
        if after > before + 1:
            self.out.at(where, "file.frames_missing", f"frames {before + 1}..{after - 1} missing "
                        f"({after - before - 1} rows)", frame_no=before + 1)
        else:
            self.out.at(where, "file.frame_order", f"frame {after} follows frame {before}",
                        frame_no=after)


def _checker(protocol: str):
    if protocol == "dcp":
        return DcpChecker()
    return SynapseChecker()


def verify(paths: list[str], *, limit: int = 1000, batch_rows: int = BATCH_ROWS,
           progress: Callable[[int], None] | None = None) -> Report:
    """Verify the captures named by `paths` (files or directories)."""
    t0 = time.perf_counter()
    out = Findings(limit)
    candidates = _candidates(list(paths), out)
    if not candidates:
        raise VerifyError("no capture files found in " + ", ".join(paths))
    files, bad, skipped = _describe_all(candidates, out)
    protocols = sorted({f.protocol for f in files})
    if len(protocols) > 1:
        raise MixedProtocols(f"captures of different protocols given together: {protocols}")
    report = Report(protocol=protocols[0] if protocols else None, findings=[], counts={},
                    files=len(candidates) - skipped, unreadable_files=bad)
    if not files:
        report.findings, report.counts = out.ordered(), dict(out.counts)
        report.seconds = time.perf_counter() - t0
        return report
    for f in files:
        _check_name(f, out)
    captures = _group(files, out)
    _check_sources(captures, out)
    report.captures = len(captures)
    checker = _checker(protocols[0])     # (files: one protocol)
    dropped = _retained_away(paths, captures, checker, out)
    for rank, segs in enumerate(captures):
        _verify_capture(rank, segs, checker, out, report, batch_rows, progress, dropped)
    checker.finish(out)
    if report.protocol == "dcp":
        check_shards(files, checker, out)
    report.findings, report.counts = out.ordered(), dict(out.counts)
    report.seconds = time.perf_counter() - t0
    return report


def _retained_away(paths: list[str], captures: list[list[reader.CaptureFile]], checker,
                   out: Findings) -> dict[str, int]:
    """capture id -> last segment a retention ring deleted (the records of the directories
    given); a capture the ring deleted whole is one info finding."""
    records = retained.records_near(paths)
    dropped = retained.dropped_through(records)
    if dropped and hasattr(checker, "retained"):
        checker.retained({vb: d for rec in records for vb, d in (rec.get("vbuckets") or {}).items()})
    present = {segs[0].capture_id for segs in captures if segs}
    for cid, seg in sorted(dropped.items()):
        if cid not in present:
            out.add(Finding("file.retained_away", f"capture {cid}: segments 0..{seg} retained away by the "
                            "retention ring (deleted, as its record says)", capture_id=cid))
    return dropped


def _verify_capture(rank: int, segs: list[reader.CaptureFile], checker, out: Findings, report: Report,
                    batch_rows: int, progress, dropped: dict[str, int] | None = None) -> None:
    """The segments of one capture, in order: file checks, then their rows through the frame
    continuity check and the protocol checker; a run of small finished segments is read and
    fed as one chunk (its findings still name the file each frame is in)."""
    frames = _Frames(out)
    expected_seg = 0
    for run in _runs(segs, batch_rows):
        wheres = [Where(f.path, f.segment, f.capture_id, rank) for f in run]
        for f, where in zip(run, wheres):
            if f.segment != expected_seg and expected_seg == 0 and (dropped or {}).get(f.capture_id, -1) >= \
                    f.segment - 1:
                out.at(where, "file.retained_away", f"segments 0..{f.segment - 1} of capture {f.capture_id} "
                       "retained away by the retention ring: what they held is not verified")
                frames.unknown()
                checker.resync()
            elif f.segment != expected_seg:
                missing = (f"segment {expected_seg}" if f.segment == expected_seg + 1
                           else f"segments {expected_seg}..{f.segment - 1}")
                out.at(where, "file.segment_missing", f"{missing} of capture {f.capture_id} missing "
                       f"before {os.path.basename(f.path)}")
                frames.unknown()
                checker.resync()
            expected_seg = f.last_segment + 1
            if f.in_progress:
                out.at(where, "file.in_progress", "unfinished segment (.arrows): the capture is "
                       "running or was killed; `capture --resume` into its directory finishes it")
        lost: list = []
        run_out, chunks = out, None
        if len(run) > 1:
            try:
                chunks, run_out = _run_chunks(run, wheres, checker.COLUMNS, out)
            except reader.CaptureError:
                chunks = None      # a damaged file among them: file by file, the damage found
        if chunks is None:
            chunks = _file_chunks(run, wheres, checker.COLUMNS, out, batch_rows, lost)
        seen_lost = 0
        frames.out = run_out
        for t, raw, where in chunks:
            if len(lost) > seen_lost:      # a damaged row group before this chunk
                seen_lost = len(lost)
                rng = lost[-1]
                if rng is None:
                    frames.unknown()
                else:
                    frames.skip_to(rng[1] + 1)
                checker.resync()
            report.rows += t.num_rows
            fn = t.column("frame_no").to_numpy()
            if not frames.feed(fn, where):
                checker.resync()
            _check_capture_ids(t, where, run_out)
            checker.feed(t, raw, where, run_out)
            if progress is not None:
                progress(t.num_rows)
        frames.out = out


def _runs(segs: list[reader.CaptureFile], batch_rows: int) -> Iterator[list[reader.CaptureFile]]:
    """Consecutive small finished segments (reader.small) with consecutive numbers together;
    any other segment alone."""
    run: list[reader.CaptureFile] = []
    rows = 0
    for f in segs:
        ok = reader.small(f)
        n = reader.footer(f.path).num_rows if ok else 0
        if run and (not ok or f.segment != run[-1].last_segment + 1 or rows + n > batch_rows
                    or len(run) >= reader.RUN_FILES):
            yield run
            run, rows = [], 0
        if ok:
            run.append(f)
            rows += n
        else:
            yield [f]
    if run:
        yield run


def _file_chunks(run, wheres, cols, out, batch_rows, lost) -> Iterator[tuple[pa.Table, Callable, Where]]:
    for f, where in zip(run, wheres):
        chunks = (_arrows_chunks(f, cols, where, out) if f.in_progress
                  else _parquet_chunks(f, cols, where, out, batch_rows, lost))
        for t, raw in chunks:
            yield t, raw, where


def _run_chunks(run, wheres, cols, out):
    """A run of small segments as one chunk, and the findings collector that puts each
    finding with a frame number on the file that frame is in."""
    # DCP: with `raw` (its checks read it for every frame): one scan, not two (reader.RunCache)
    extra = ["raw"] if run[0].protocol == "dcp" else []
    t = reader.read_segments(run, list(dict.fromkeys(cols + extra)), sort=False).select(cols)
    sizes = [reader.footer(f.path).num_rows for f in run]
    offsets = np.cumsum([0] + sizes[:-1])
    fn = t.column("frame_no").to_numpy()
    firsts = [int(fn[o]) if n else (1 << 62) for o, n in zip(offsets, sizes)]
    lasts = [int(fn[o + n - 1]) if n else (1 << 62) for o, n in zip(offsets, sizes)]

    def raw() -> pa.Array:
        return reader.read_segments(run, ["raw"], sort=False).column("raw").combine_chunks()
    return iter([(t, raw, wheres[0])]), _RunFindings(out, wheres, firsts, lasts)


class _RunFindings:
    """Findings about a run of segments read as one chunk: a finding at a frame goes to the
    segment holding it (by the first frame of each), the rest as given."""

    def __init__(self, out: Findings, wheres: list[Where], firsts: list[int], lasts: list[int]):
        self._out, self._wheres, self._firsts, self._lasts = out, wheres, firsts, lasts

    def at(self, where, check, message, frame_no=None, **loc) -> None:
        if frame_no is not None and where is not None and where in self._wheres:
            i = max(0, bisect.bisect_right(self._firsts, frame_no) - 1)
            if frame_no > self._lasts[i] and i + 1 < len(self._wheres):
                i += 1          # a frame between two segments (a hole): the later one, as file by file
            where = self._wheres[i]
        self._out.at(where, check, message, frame_no=frame_no, **loc)

    def __getattr__(self, name):
        return getattr(self._out, name)


def _check_capture_ids(t: pa.Table, where: Where, out: Findings) -> None:
    col = t.column("capture_id")
    if col.null_count == len(col):
        return
    values = col.unique() if not pa.types.is_dictionary(col.type) else None
    if values is None:
        chunk = col.combine_chunks()
        used = np.unique(chunk.indices.to_numpy(zero_copy_only=False)[chunk.is_valid().to_numpy(zero_copy_only=False)])
        values = chunk.dictionary.take(pa.array(used, pa.int64()))
    bad = [v for v in values.to_pylist() if v is not None and v != where.capture_id]
    if bad or col.null_count:
        fn = t.column("frame_no").to_numpy()
        mask = ~np.isin(np.asarray(col.cast(pa.string()).to_pylist(), dtype=object), [where.capture_id])
        first = int(fn[np.flatnonzero(mask)[0]]) if mask.any() else None
        out.at(where, "file.capture_id_mismatch", f"capture_id column holds {bad[:3] or [None]} "
               f"(file metadata: {where.capture_id})", frame_no=first)
