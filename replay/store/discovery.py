"""Finding capture files and what their footers say, without pyarrow (and where an output may
go: never over a capture file or into a capture directory, `output_problem`): which files a list of
paths names (finished Parquet segments and in-progress Arrow IPC streams), what each is
(`describe`: the dcptool metadata of its footer or stream schema), their order (started_at of
the capture, capture_id, segment) and ranks, and what the Parquet statistics tell of a column
(`null_by_statistics`). The footers are read by replay/store/footers.py (pyarrow's reader once
pyarrow is loaded, else its small one); an in-progress segment's schema by pyarrow.
replay/store/reader.py reads the rows, and re-exports these names (reader.find_captures ...).

When both `.arrows` and `.parquet` of one segment exist, the `.parquet` wins; when a merged
segment (replay/store/compact.py) and any of the parts it covers exist, the merged one wins
and the parts are not read."""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import sys
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from dcptool.protocol.text import printable
from dcptool.replay.store.capture_errors import (
    CaptureError,
    NotACapture,
    OutputIsCapture,
    UnsupportedFormat,
)
from dcptool.replay.store.files import arrow_path, first_line, remove_quiet, shown
from dcptool.replay.store.footers import key_values, null_state, prefetch_footers
from dcptool.replay.store.naming import (
    DAMAGED_SUFFIX,
    IN_PROGRESS_SUFFIX,
    META_CAPTURE_ID,
    META_FORMAT,
    META_PROTOCOL,
    META_SEGMENT,
    META_SEGMENT_LAST,
    META_STARTED_AT,
    PROTOCOLS,
    READABLE_VERSIONS,
    SEGMENT_NAME_RE,
    TMP_SUFFIX,
    is_segment_name,
    tool_version,
)

FINISHED_SUFFIX = ".parquet"

_NAME_RE = SEGMENT_NAME_RE


@dataclass(frozen=True)
class CaptureFile:
    path: str
    protocol: str
    capture_id: str
    segment: int
    started_at: str  # ISO 8601 UTC, as in the dcptool.started_at metadata
    in_progress: bool
    metadata: dict[str, str] = field(hash=False, compare=False)

    @property
    def last_segment(self) -> int:
        """The last segment number the file holds (`segment` but for a merged segment)."""
        try:
            return max(self.segment, int(self.metadata.get(META_SEGMENT_LAST, self.segment)))
        except ValueError:
            return self.segment


def without_covered(files: list[CaptureFile]) -> tuple[list[CaptureFile], list[CaptureFile]]:
    """(files kept, parts covered): a segment whose number lies in the range of a merged
    segment of the same capture (a crash between compaction's rename and its deletes left
    both) is covered, the merged one wins. Order kept."""
    merged: dict[str, list[CaptureFile]] = {}
    for f in files:
        if f.last_segment > f.segment and not f.in_progress:
            merged.setdefault(f.capture_id, []).append(f)
    if not merged:
        return list(files), []
    kept, covered = [], []
    for f in files:
        if any(m is not f and m.segment <= f.segment and f.last_segment <= m.last_segment
               and (m.segment, m.last_segment) != (f.segment, f.last_segment)
               for m in merged.get(f.capture_id, ())):
            covered.append(f)
        else:
            kept.append(f)
    return kept, covered


def parse_started(text: str) -> _dt.datetime:
    try:
        t = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise CaptureError(f"bad dcptool.started_at {text!r}") from exc
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return t.astimezone(_dt.timezone.utc)


def order_key(f: CaptureFile):
    return (parse_started(f.started_at), f.capture_id, f.segment)


def _metadata_of(path: str, in_progress: bool) -> dict[bytes, bytes]:
    if in_progress:
        import pyarrow as pa
        import pyarrow.ipc as ipc
        with pa.OSFile(arrow_path(path), "rb") as fh:
            return ipc.open_stream(fh).schema.metadata or {}
    return key_values(path)


def _read_errors() -> tuple:
    """The errors of reading a footer or a stream's schema (pyarrow's only once it is loaded)."""
    pa = sys.modules.get("pyarrow")
    return (OSError, EOFError) + ((pa.ArrowException,) if pa is not None else ())


def describe(path: str) -> CaptureFile:
    """The CaptureFile of one file: NotACapture when it holds no dcptool capture,
    UnsupportedFormat when its format is newer than this build reads."""
    in_progress = path.endswith(IN_PROGRESS_SUFFIX)
    try:
        raw = _metadata_of(path, in_progress)
    except Exception as exc:
        if not isinstance(exc, _read_errors()):
            raise
        raise NotACapture(f"{shown(path)}: not a readable capture file ({first_line(exc)})") from exc
    meta = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace")
            for k, v in raw.items() if k.startswith(b"dcptool.")}
    missing = [k for k in (META_PROTOCOL, META_CAPTURE_ID, META_STARTED_AT) if k not in meta]
    if missing:
        raise NotACapture(f"{shown(path)}: not a dcptool capture (metadata {', '.join(missing)} missing)")
    protocol = meta[META_PROTOCOL]
    if protocol not in PROTOCOLS:
        raise CaptureError(f"{shown(path)}: invalid value of metadata {META_PROTOCOL}: {_quoted(protocol)} "
                           f"(one of {', '.join(sorted(PROTOCOLS))})")
    if not meta[META_CAPTURE_ID].strip():
        raise CaptureError(f"{shown(path)}: invalid value of metadata {META_CAPTURE_ID}: empty")
    version = meta.get(META_FORMAT, READABLE_VERSIONS[0])
    if version not in READABLE_VERSIONS:
        raise UnsupportedFormat(f"{shown(path)}: capture format {version!r} is not one this dcptool "
                                f"{tool_version()} reads ({', '.join(READABLE_VERSIONS)}): a newer "
                                "dcptool wrote it")
    try:
        segment = int(meta.get(META_SEGMENT, "0"))
        if segment < 0:
            raise ValueError(segment)
    except ValueError as exc:
        raise CaptureError(f"{shown(path)}: invalid value of metadata {META_SEGMENT}: "
                           f"{_quoted(meta.get(META_SEGMENT, '0'))} (a segment number)") from exc
    try:
        parse_started(meta[META_STARTED_AT])
    except CaptureError:
        raise CaptureError(f"{shown(path)}: invalid value of metadata {META_STARTED_AT}: "
                           f"{_quoted(meta[META_STARTED_AT])} (an RFC 3339 time)") from None
    return CaptureFile(path=path, protocol=protocol, capture_id=meta[META_CAPTURE_ID],
                       segment=segment, started_at=meta[META_STARTED_AT],
                       in_progress=in_progress, metadata=meta)


def _quoted(value: str) -> str:
    """A metadata value for a message: quoted, at most 60 characters of it."""
    return repr(value if len(value) <= 60 else value[:60] + "...")


def _not_a_capture_path(p: str) -> str:
    """What a path that is neither a file nor a directory is (a message)."""
    import errno
    import stat
    try:
        st = os.stat(p)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop, not a capture file"
        if os.path.islink(p):
            return "a symlink to nothing (no such file or directory)"
        if exc.errno == errno.ENOENT:
            return "no such file or directory"
        return f"cannot read it ({exc.strerror})"
    kind = ("a character device" if stat.S_ISCHR(st.st_mode) else "a block device" if stat.S_ISBLK(st.st_mode)
            else "a named pipe" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
            else "not a regular file")
    return f"{kind}, not a capture file"


_WARNED: set[str] = set()


def warn(message: str) -> None:
    """One warning line on stderr, once per message and process (files skipped in a capture
    directory: a command may look at a directory more than once)."""
    if message in _WARNED:
        return
    _WARNED.add(message)
    try:
        sys.stderr.write(f"dcptool: warning: {printable(message)}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


def _listed(directory: str) -> Iterator[tuple[str, bool]]:
    """The capture files of a directory (not recursively), and whether each is named as a
    segment; other files are skipped, with a warning for the ones that look like data."""
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if name.startswith("."):
            continue
        if name.endswith((FINISHED_SUFFIX, IN_PROGRESS_SUFFIX)):
            if os.path.isfile(full):
                yield full, bool(_NAME_RE.match(name))
        elif DAMAGED_SUFFIX in name and IN_PROGRESS_SUFFIX in name:
            warn(f"{shown(full)}: a damaged in-progress segment kept aside (not read; "
                 "`dcptool verify` tells what it holds)")


def find_captures(paths: Iterable[str]) -> list[CaptureFile]:
    """Capture files named by `paths` (files, or directories whose *.parquet and *.arrows
    are taken, not recursively), sorted by (started_at, capture_id, segment). A file inside
    a directory that is no capture and is not named as a segment (an output written there,
    any foreign `.parquet`) is skipped with a warning on stderr; a file named as a segment
    that cannot be read, or any file given by name, is an error."""
    candidates: list[tuple[str, bool, bool]] = []  # (path, found inside a directory, named as a segment)
    for p in paths:
        if os.path.isdir(p):
            candidates.extend((full, True, named) for full, named in _listed(p))
        elif os.path.isfile(p):
            candidates.append((p, False, True))
        else:
            raise CaptureError(f"{shown(p)}: {_not_a_capture_path(p)}")
    prefetch_footers([c[0] for c in candidates if c[0].endswith(FINISHED_SUFFIX)])
    seen: set[str] = set()
    found: list[CaptureFile] = []
    for path, in_dir, named in candidates:
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        if in_dir and path.endswith(IN_PROGRESS_SUFFIX) and os.path.getsize(path) == 0:
            continue  # a writer that has just opened its segment: nothing to read yet
        try:
            f = describe(path)
        except NotACapture:
            if in_dir and not named:
                warn(f"{shown(path)}: not a dcptool capture segment, skipped")
                continue
            raise
        found.append(f)
    by_segment: dict[tuple[str, int], CaptureFile] = {}
    for f in without_covered(found)[0]:
        key = (f.capture_id, f.segment)
        old = by_segment.get(key)
        if old is None or (old.in_progress and not f.in_progress):
            by_segment[key] = f
        elif old.in_progress == f.in_progress:
            raise CaptureError(f"{shown(f.path)}: segment {f.segment} of capture {f.capture_id} "
                               f"also in {shown(old.path)}")
    files = sorted(by_segment.values(), key=order_key)
    protocols = {f.protocol for f in files}
    if len(protocols) > 1:
        raise CaptureError(f"captures of different protocols given together: {sorted(protocols)}")
    return files


def capture_ranks(files: list[CaptureFile]) -> dict[str, int]:
    """capture_id -> its rank in frame order (0 for the earliest capture)."""
    ranks: dict[str, int] = {}
    for f in sorted(files, key=order_key):
        ranks.setdefault(f.capture_id, len(ranks))
    return ranks


def protocol_of(files: list[CaptureFile]) -> str:
    if not files:
        raise CaptureError("no capture files found")
    return files[0].protocol


def null_by_statistics(files: list[CaptureFile], column: str) -> bool | None:
    """True when the Parquet statistics show `column` null in every row of `files`, False
    when they show a value in some row, None when they cannot tell (a segment in progress, or
    without statistics): reader.may_have_values then reads the column."""
    unknown = False
    for f in files:
        state = None if f.in_progress else null_state(f.path, column)
        if state == "values":
            return False
        unknown = unknown or state is None
    return None if unknown else True


# ------------------------------------------------- outputs never over a capture (issue 36)
# Where a command's output may go: never over a capture file, never into a capture directory,
# and written whole or not at all (`report -o`, `export -o`, `import -o`, `replay -o`; later
# the checkpoints of `restore`).

def holds_segments(directory: str) -> bool:
    """Whether `directory` is a capture directory: it holds files named as capture segments
    (finished, in progress, or kept aside as damaged)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return any(is_capture_name(n) for n in names)


def is_capture_name(name: str) -> bool:
    """A name a capture writer or its recovery gives a file (a segment, its `.arrows` twin,
    its `.parquet.tmp` or a damaged `.arrows.damaged[.N]` kept aside)."""
    if is_segment_name(name):
        return True
    if name.endswith(TMP_SUFFIX) and is_segment_name(name[:-len(TMP_SUFFIX)]):
        return True
    base = name.split(DAMAGED_SUFFIX)[0]
    return DAMAGED_SUFFIX in name and base.endswith(IN_PROGRESS_SUFFIX) and is_segment_name(base)


def is_capture_file(path: str) -> bool:
    """A file named as a capture file, or any file whose footer (schema) holds dcptool capture
    metadata whatever its name."""
    if is_capture_name(os.path.basename(path)):
        return True
    if not os.path.isfile(path):
        return False
    try:
        describe(path)
    except (CaptureError, OSError, ValueError):
        return False
    return True


def output_problem(path: str, *, directory: bool = False, option: str = "-o") -> str | None:
    """Why `path` may not be written as an output, or None: it is a capture file, or inside a
    capture directory; with `directory` (the output is a directory) it is a capture directory."""
    real = os.path.realpath(path)
    if directory:
        if os.path.isdir(real) and holds_segments(real):
            return (f"{option} {shown(path)} is a capture directory: an output never goes into one; "
                    "give another directory")
        return None
    if is_capture_file(real) or is_capture_name(os.path.basename(path)):
        return f"{option} {shown(path)} is a capture file: an output never replaces one; give another path"
    parent = os.path.dirname(real)
    if holds_segments(parent):
        return (f"{option} {shown(path)} is inside a capture directory ({shown(parent)}): an output never "
                "goes into one; give another path")
    return None


def check_output(path: str, *, directory: bool = False, option: str = "-o") -> None:
    """Raise OutputIsCapture (a usage error, exit 2) when `output_problem` finds one."""
    problem = output_problem(path, directory=directory, option=option)
    if problem is not None:
        raise OutputIsCapture(problem)


def temporary_name(path: str, tag: str = "tmp") -> str:
    """A hidden name next to `path` (same directory, so a rename replaces it atomically; hidden,
    so no reader of the directory takes it for data)."""
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}.{tag}-{os.getpid()}")


@contextlib.contextmanager
def written_whole(path: str) -> Iterator[str]:
    """Yield the temporary name to write `path` under; on a clean exit it is renamed over
    `path`, on an error (or an interrupt) removed: a failed write leaves no partial output."""
    tmp = temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        remove_quiet(tmp)
        raise
