"""Tables for people, rendered row by row as plain fixed-width text (cli/output.py Sink).

A rich Table lays out every row before it prints the first, which made a 10k-row table
take 25 times as long as its JSON lines; this renderer formats each batch as it comes, in
about the time JSON lines take. Rules:
- Numbers, ids and names are never wrapped or cut; numbers are right-aligned.
- On a terminal, long text columns (keys, values, details, ...) fold to fit its width (when
  the whole columns alone leave room for them; otherwise lines are left to the terminal).
- Anywhere else (a pipe, a file) nothing is wrapped or cut: no width limit.
- Widths come from the first batch and only grow; on a terminal the header is printed again
  when the layout changes, elsewhere only when a column appears that was empty so far.
Every cell goes through output.printable: nothing from the other side reaches the terminal
with its control characters.
"""

from __future__ import annotations

import base64
import os

import orjson

from dcptool.protocol.text import printable

SEP = "  "
MIN_WRAP = 10      # a folded column is never narrower than this
WRAP_OVER = 24     # text columns wider than this may fold on a terminal
# ids and names: kept whole even when long
WHOLE = frozenset({"ts", "conn", "direction", "op", "opcode", "magic", "status", "vbucket", "opaque",
                   "cas", "datatype", "stream_id", "collection_id", "stream", "instance", "command",
                   "token", "capture_id", "frame_no", "table", "state", "first_ts", "last_ts",
                   "snap_version", "channel", "sha256"})


def cell_text(v) -> str:
    """A value as one line of text (not yet escaped)."""
    if v is None:
        return ""
    t = type(v)
    if t is str:
        return v
    if t is int:
        return str(v)
    if t is float:
        return f"{v:g}"
    if t is bool:
        return "true" if v else "false"
    if isinstance(v, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(v)).decode("ascii")
    if isinstance(v, (dict, list, tuple)):
        try:
            return orjson.dumps(v, default=_json_bytes).decode("utf-8")
        except TypeError:
            return str(v)
    return str(v)


def _json_bytes(obj):
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(obj)).decode("ascii")
    return str(obj)


_INTS = frozenset({int, type(None)})
_NUMERIC = frozenset({int, float, type(None)})


def _width(s: str) -> int:
    if s.isascii():
        return len(s)
    from rich.cells import cell_len
    return cell_len(s)


def _fold(s: str, w: int) -> list[str]:
    if s.isascii():
        return [s[i:i + w] for i in range(0, len(s), w)] or [""]
    from rich.cells import get_character_cell_size
    out, cur, n = [], [], 0
    for ch in s:
        cw = get_character_cell_size(ch)
        if n + cw > w and cur:
            out.append("".join(cur))
            cur, n = [], 0
        cur.append(ch)
        n += cw
    out.append("".join(cur))
    return out


def terminal_width(out) -> int | None:
    """The width of the terminal `out` writes to, or None when it is not a terminal."""
    try:
        if not out.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return os.get_terminal_size(out.fileno()).columns or 80
    except (OSError, AttributeError, ValueError):
        return 80


class TextTable:
    """Writes rows (dicts) to `out` as an aligned table, one batch at a time."""

    def __init__(self, out, columns: list[str] | None = None, title: str | None = None,
                 width: int | None = None):
        self.out = out
        self.columns = list(columns) if columns else None
        self.title = title
        self.width = width            # a terminal's width; None: no limit, never fold
        self.order: list[str] = []    # every column seen, in column order
        self.shown: list[str] = []
        self.natural: dict[str, int] = {}
        self.numeric: dict[str, bool] = {}
        self.widths: list[int] = []
        self.wrap: list[bool] = []
        self.headers = 0

    # -- layout --------------------------------------------------------------------------

    def _columns_of(self, rows: list[dict]) -> list[str]:
        if self.columns is not None:
            return self.columns
        seen = dict.fromkeys(self.order)
        for r in rows:
            for k in r:
                if k not in seen:
                    seen[k] = None
        self.order = list(seen)
        return self.order

    def _layout(self) -> tuple[list[int], list[bool]]:
        nat = [self.natural[c] for c in self.shown]
        wrap = [self.width is not None and not self.numeric[c] and c not in WHOLE and n > WRAP_OVER
                for c, n in zip(self.shown, nat)]
        if self.width is None:
            return nat, [False] * len(nat)
        total = sum(nat) + len(SEP) * (len(nat) - 1)
        if total <= self.width or not any(wrap):
            return nat, [False] * len(nat)
        fixed = sum(n for n, w in zip(nat, wrap) if not w) + len(SEP) * (len(nat) - 1)
        remaining = self.width - fixed
        if remaining < MIN_WRAP * sum(wrap):
            # the whole columns alone are wider than the terminal: folding cannot make a row
            # fit, it would only multiply its lines; the terminal wraps the line instead
            return nat, [False] * len(nat)
        idx = sorted((i for i, w in enumerate(wrap) if w), key=lambda i: nat[i])
        widths = list(nat)
        for k, i in enumerate(idx):
            share = remaining // (len(idx) - k)
            floor = max(MIN_WRAP, _width(self.shown[i]))
            widths[i] = max(floor, min(nat[i], share))
            remaining -= widths[i]
        return widths, [w and widths[i] < nat[i] for i, w in enumerate(wrap)]

    # -- writing -------------------------------------------------------------------------

    def write(self, rows: list[dict]) -> None:
        if not rows:
            return
        cols = self._columns_of(rows)
        # column by column: whole-column checks run at C speed (the bulk is plain ASCII)
        values = {c: [r.get(c) for r in rows] for c in cols}
        present = [c for c in cols if c in self.natural or any(v is not None for v in values[c])]
        new_cols = present != self.shown
        columns, plain = [], True
        for c in present:
            vals = values[c]
            types = set(map(type, vals))
            if c not in self.natural:
                self.numeric[c] = types <= _NUMERIC
                self.natural[c] = _width(c)
            if types <= _INTS:
                cells = ["" if v is None else str(v) for v in vals]
                n = max(map(len, cells))
            else:
                cells = ["" if v is None else v if type(v) is str else cell_text(v) for v in vals]
                joined = "".join(cells)
                if not (joined.isascii() and joined.isprintable()):
                    cells = [printable(x) for x in cells]
                if joined.isascii():
                    n = max(map(len, cells))
                else:
                    plain = False
                    n = max(map(_width, cells))
            if n > self.natural[c]:
                self.natural[c] = n
            columns.append(cells)
        self.shown = present
        widths, wrap = self._layout()
        relayout = widths != self.widths
        self.widths, self.wrap = widths, wrap
        parts = []
        if self.headers == 0 or new_cols or (relayout and self.width is not None):
            parts.append(self._header())
        right = [self.numeric[c] for c in present]
        # one format call per plain row; a cell wider than its column (a later, longer id)
        # pushes the rest of its line rather than being cut
        specs = [("{:>%d}" if r else "{:<%d}") % w for r, w in zip(right, widths)]
        if not right[-1]:
            specs[-1] = "{}"   # no trailing blanks
        line_fmt = SEP.join(specs) + "\n"
        folding = [j for j, f in enumerate(wrap) if f]
        if folding:
            long_rows = set()
            for j in folding:
                w = widths[j]
                long_rows.update(i for i, x in enumerate(columns[j]) if len(x) > w and _width(x) > w)
        else:
            long_rows = ()
        for i, row in enumerate(zip(*columns)):
            if i in long_rows:
                parts.append(self._folded(row, widths, wrap, right))
            elif plain:
                parts.append(line_fmt.format(*row))
            else:
                parts.append(self._padded(row, widths, right))
        self.out.write("".join(parts))

    @staticmethod
    def _padded(row, widths, right) -> str:
        line = []
        for s, w, r in zip(row, widths, right):
            pad = max(0, w - _width(s))
            line.append((" " * pad + s) if r else s + " " * pad)
        return SEP.join(line).rstrip() + "\n"

    def _folded(self, row, widths, wrap, right) -> str:
        pieces = [_fold(s, w) if f and _width(s) > w else [s] for s, w, f in zip(row, widths, wrap)]
        lines = []
        for k in range(max(map(len, pieces))):
            lines.append(self._padded([p[k] if k < len(p) else "" for p in pieces], widths, right))
        return "".join(lines)

    def _header(self) -> str:
        tty = self.width is not None
        out = ""
        if self.headers == 0 and self.title:
            out += (f"\x1b[1m{self.title}\x1b[0m" if tty else self.title) + "\n"
        cells = []
        for c, w in zip(self.shown, self.widths):
            cells.append(c.rjust(w) if self.numeric[c] else c.ljust(w))
        line = SEP.join(cells).rstrip()
        self.headers += 1
        return out + (f"\x1b[1m{line}\x1b[0m" if tty else line) + "\n"
