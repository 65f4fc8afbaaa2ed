"""Tables for people, rendered row by row as plain fixed-width text (cli/view/output.py Sink
writes every command's tables through it).

A rich Table lays out every row before it prints the first, which made a 10k-row table
take 25 times as long as its JSON lines; this renderer formats each batch as it comes, in
about the time JSON lines take. Rules:
- Numbers, ids, names and keys are never wrapped or cut; numbers are right-aligned.
- On a terminal, where a batch does not fit at the widths so far, it gets a layout of its
  own in which the columns empty in all of its rows take no room (the last layout is kept
  while it holds a batch). The document values (`value`, `value_base64`) take the room the
  other columns leave and are cut with "…" after two lines; other long text (details,
  explanations, errors, ...) wraps to fit. Text wraps only between words (at spaces, and
  after the commas of JSON: text_wrap.py), never inside a word, key, id or number; a
  column is never narrower than its widest word when a line can hold it, and a word no
  line can hold is cut with "…". When the columns do not fit one line even so, or a value
  would be cut that a line of its own shows whole, a row goes on over indented lines
  ("bands" of whole columns, each with its header line; a value ends its band), so the
  terminal never splits a cell; a band whose cells are all empty in a row is left out.
- A sticky table (`stream`'s live view) shows its declared columns from its first header,
  keeps its layout while it holds a batch (a longer id pushes the rest of its line while
  the line fits) and only grows it; an optional column (`ts`) is shown when it costs no
  line of its own.
- Anywhere else (a pipe, a file) nothing is wrapped or cut: no width limit; widths come
  from the first batch and only grow, and the header is printed again only when a column
  appears that was empty so far (on a terminal: whenever the layout changes).
Every cell goes through output.printable: nothing from the other side reaches the terminal
with its control characters.
"""

from __future__ import annotations

import base64
import os

import orjson

from dcptool.live.text_wrap import ELIDE_LINES, MARK, longest_word  # noqa: F401 - MARK, ELIDE_LINES: re-exported
from dcptool.live.text_wrap import elide as _elide
from dcptool.live.text_wrap import fold as _fold
from dcptool.live.text_wrap import width as _width
from dcptool.protocol.text import printable

SEP = "  "
MIN_WRAP = 10      # a folded column is never narrower than this
WRAP_OVER = 24     # text columns wider than this may fold on a terminal
# ids and names: kept whole even when long
WHOLE = frozenset({"ts", "conn", "direction", "op", "opcode", "magic", "status", "vbucket", "opaque",
                   "cas", "datatype", "stream_id", "collection_id", "stream", "instance", "command",
                   "token", "capture_id", "frame_no", "table", "state", "first_ts", "last_ts",
                   "snap_version", "channel", "sha256", "key", "key_base64", "node"})
# columns a live view shows only once they have a value (the others from its first header)
RARE = frozenset({"key_base64", "value_base64", "value_error", "node"})
# document values: on a terminal they take the room left and are cut after ELIDE_LINES lines
ELIDE = frozenset({"value", "value_base64"})
INDENT = "    "    # the continuation lines of a row that does not fit one line


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
                 width: int | None = None, *, sticky: bool = False, optional: frozenset[str] = frozenset(),
                 first_widths: dict[str, int] | None = None):
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
        self.bands: list[list[int]] | None = None   # column indexes per line; None: one line
        self.headers = 0
        self.sticky = sticky          # a live view: the layout only grows (_choose)
        self.optional = optional      # columns shown only where they cost no line (_plan_columns)
        self.dropped: set[str] = set()   # the optional columns the layout left out
        self.word: dict[str, int] = {}   # a wrapping column's widest word so far
        # a sticky table shows its declared columns from its first header (but the rare ones)
        self.reserved = frozenset(self.columns or ()) - RARE if sticky else frozenset()
        self.untyped: set[str] = set()   # shown while empty: number or text not known yet
        self.first_widths = first_widths or {}   # columns' least widths from the start (a live view)

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

    def _wraps(self, c: str, n: int) -> bool:
        """Whether text column `c` (natural width n) may wrap over lines on a terminal."""
        return not self.numeric[c] and c not in WHOLE and c not in ELIDE and n > WRAP_OVER

    def _floor(self, c: str, word: int, width: int) -> int:
        """The narrowest a wrapping column `c` may be on a line of `width`: its widest word
        (so that no word is cut), its header, MIN_WRAP; at most the line."""
        return min(width, max(MIN_WRAP, _width(c), word))

    def _layout(self, shown: list[str], nat: list[int], width: int | None,
                wl: list[int]) -> tuple[list[int], list[bool]]:
        """Widths of the columns `shown` (natural widths `nat`, widest words `wl`) on one line
        of `width`, and which columns wrap (or, ELIDE ones, are cut) in this layout."""
        if width is None:
            return nat, [False] * len(nat)
        elide = [c in ELIDE for c in shown]
        wrap = [e or self._wraps(c, n) for c, n, e in zip(shown, nat, elide)]
        total = sum(nat) + len(SEP) * (len(nat) - 1)
        if total <= width or not any(wrap):
            return nat, [False] * len(nat)
        floors = [min(n, max(MIN_WRAP, _width(c))) if e else self._floor(c, k, width) if w else n
                  for c, n, k, e, w in zip(shown, nat, wl, elide, wrap)]
        fixed = sum(n for n, w in zip(nat, wrap) if not w) + len(SEP) * (len(nat) - 1)
        remaining = width - fixed
        if remaining < sum(f for f, w in zip(floors, wrap) if w):
            # the whole columns alone are wider than the terminal: wrapping cannot make the
            # line fit, it would only multiply its lines (_plan gives such columns bands)
            return floors, [w and f < n for w, f, n in zip(wrap, floors, nat)]
        idx = sorted((i for i, w in enumerate(wrap) if w), key=lambda i: nat[i])
        widths = list(nat)
        for k, i in enumerate(idx):
            share = remaining // (len(idx) - k)
            widths[i] = max(floors[i], min(nat[i], share))
            remaining -= widths[i]
        return widths, [w and widths[i] < nat[i] for i, w in enumerate(wrap)]

    def _fits(self, nat: list[int], width: int) -> bool:
        return sum(nat) + len(SEP) * (len(nat) - 1) <= width

    def _least(self, c: str, n: int, word: int, width: int) -> int:
        """The narrowest column `c` (natural width n, widest word `word`) may be on a
        terminal of `width` (a band line: less its indent)."""
        if c in ELIDE:   # (its widest word too: a value's word is cut only when no line holds it)
            return min(n, max(WRAP_OVER, _width(c), min(word, width - len(INDENT))))
        if self._wraps(c, n):
            return self._floor(c, word, width - len(INDENT))
        return n

    def _plan(self, shown: list[str], nat: list[int], wl: list[int]):
        """(widths, wrap, bands) of the columns `shown`: one line when they fit the width at
        their narrowest (no word cut) and no value is cut that bands would show whole, else
        bands of whole columns, each fitting an (indented) line, a value ending its band."""
        width = self.width
        if width is None:
            return nat, [False] * len(nat), None
        least = [self._least(c, n, k, width) for c, n, k in zip(shown, nat, wl)]
        if not self._fits(least, width):
            return self._bands(shown, nat, least, width, wl)
        widths, wrap = self._layout(shown, nat, width, wl)
        values = [i for i, c in enumerate(shown) if c in ELIDE]
        last = len(shown) - 1
        if all(widths[i] >= nat[i] for i in values) or values[-1] == last and widths[last] >= wl[last]:
            return widths, wrap, None   # (a value at the end of the line wraps with no word cut)
        banded = self._bands(shown, nat, least, width, wl)
        if all(banded[0][i] >= nat[i] for i in values):   # the value whole on its line
            return banded
        return widths, wrap, None

    def _bands(self, shown: list[str], nat: list[int], least: list[int], width: int, wl: list[int]):
        bands: list[list[int]] = [[]]
        used = 0
        for i, n in enumerate(least):
            room = width - (len(INDENT) if len(bands) > 1 else 0)
            add = n + (len(SEP) if bands[-1] else 0)
            # a value ends its band: it takes the rest of that line
            if bands[-1] and (used + add > room or shown[bands[-1][-1]] in ELIDE):
                bands.append([])
                add = n
                used = 0
            bands[-1].append(i)
            used += add
        if len(bands) == 1:
            return self._layout(shown, nat, width, wl) + (None,)
        widths, wrap = list(nat), [False] * len(nat)
        for b, idx in enumerate(bands):
            w, f = self._layout([shown[i] for i in idx], [nat[i] for i in idx],
                                width - (len(INDENT) if b else 0), [wl[i] for i in idx])
            for i, wi, fi in zip(idx, w, f):
                widths[i], wrap[i] = wi, fi
        return widths, wrap, bands

    def _cells(self, vals: list) -> tuple[list[str], int, bool]:
        """A column's cells as escaped text, their widest, and whether all of it is ASCII."""
        if set(map(type, vals)) <= _INTS:
            cells = ["" if v is None else str(v) for v in vals]
            return cells, max(map(len, cells)), True
        cells = ["" if v is None else v if type(v) is str else cell_text(v) for v in vals]
        joined = "".join(cells)
        if not (joined.isascii() and joined.isprintable()):
            cells = [printable(x) for x in cells]
        if joined.isascii():
            return cells, max(map(len, cells)), True
        return cells, max(map(_width, cells)), False

    def _plan_columns(self, present: list[str], columns: list[list[str]], nat: list[int], wl: list[int]):
        """(columns, cells, widths, wrap, bands) of a layout of `present`, without the
        optional columns (`ts`) when they would cost each row a line more (a sticky table
        decides it once, at its first layout)."""
        opt = [j for j, c in enumerate(present) if c in self.optional]
        rest = [j for j in range(len(present)) if j not in opt]
        if opt and self.sticky and self.headers:
            if self.dropped:
                return ([present[j] for j in rest], [columns[j] for j in rest]) + self._plan(
                    [present[j] for j in rest], [nat[j] for j in rest], [wl[j] for j in rest])
            return (present, columns) + self._plan(present, nat, wl)
        plan = self._plan(present, nat, wl)
        self.dropped = set()
        if opt and plan[2] is not None:
            fewer = self._plan([present[j] for j in rest], [nat[j] for j in rest], [wl[j] for j in rest])
            if len(fewer[2] or [0]) < len(plan[2]):
                self.dropped = {present[j] for j in opt}
                return ([present[j] for j in rest], [columns[j] for j in rest]) + fewer
        return (present, columns) + plan

    def _holds(self, present: list[str], batch: list[int], bword: list[int]) -> bool:
        """Whether the last layout holds a batch (widths `batch`, widest words `bword`). In
        a sticky table a cell wider than its column may push the rest of its line while
        the line still fits the terminal (no new header for one longer key)."""
        at = {c: j for j, c in enumerate(present)}
        over = [0 if self.wrap[k] else batch[at[c]] - self.widths[k] for k, c in enumerate(self.shown)]
        if not all(bword[at[c]] <= self.widths[k] for k, c in enumerate(self.shown) if self.wrap[k]):
            return False
        if not self.sticky or self.width is None:
            return all(o <= 0 for o in over)
        for b, idx in enumerate(self.bands or [list(range(len(self.shown)))]):
            room = self.width - (len(INDENT) if b else 0)
            used = sum(self.widths[i] for i in idx) + len(SEP) * (len(idx) - 1)
            if used + sum(max(0, over[i]) for i in idx) > room:
                return False
        return True

    def _choose(self, present: list[str], columns: list[list[str]], batch: list[int], bword: list[int]):
        """The layout of a batch: (columns, their cells, widths, which fold, bands). Where the
        columns seen so far fit (or there is no width limit), all of them at their widest so
        far; on a terminal they do not fit, the last layout when it holds this batch (no
        header again), else one of this batch's own: its widths, and the columns empty in
        all of its rows take no room. A `sticky` table (a live view) keeps its columns and
        widths while they hold a batch, and else grows them: its header comes again only
        when a column or a width must be added."""
        nat = [self.natural[c] for c in present]
        wl = [self.word.get(c, 0) for c in present]
        keep = [j for j, cells in enumerate(columns) if any(cells)] or list(range(len(present)))
        if self.width is not None and self.shown and (self.sticky or not self._fits(nat, self.width)) and \
                all(present[j] in self.shown or present[j] in self.dropped for j in keep) and \
                self._holds(present, batch, bword):
            at = {c: j for j, c in enumerate(present)}
            return self.shown, [columns[at[c]] for c in self.shown], self.widths, self.wrap, self.bands
        if self.width is None or not self.sticky and self._fits(nat, self.width):
            return self._plan_columns(present, columns, nat, wl)
        if self.sticky:   # (its declared columns from the first batch on: one header)
            union = set(self.shown or self.columns or ()) | {present[j] for j in keep}
            keep = [j for j, c in enumerate(present) if c in union]
            return self._plan_columns([present[j] for j in keep], [columns[j] for j in keep],
                                      [nat[j] for j in keep], [wl[j] for j in keep])
        return self._plan_columns([present[j] for j in keep], [columns[j] for j in keep],
                                  [batch[j] for j in keep], [bword[j] for j in keep])

    # -- writing -------------------------------------------------------------------------

    def write(self, rows: list[dict]) -> None:
        if not rows:
            return
        cols = self._columns_of(rows)
        # column by column: whole-column checks run at C speed (the bulk is plain ASCII)
        values = {c: [r.get(c) for r in rows] for c in cols}
        present = [c for c in cols if c in self.natural or c in self.reserved or any(v is not None for v in values[c])]
        columns, batch, plain = [], [], True
        bword: list[int] = []
        for c in present:
            vals = values[c]
            if c not in self.natural or c in self.untyped:
                self.natural.setdefault(c, max(_width(c), self.first_widths.get(c, 0)))
                typed = any(v is not None for v in vals)
                self.numeric[c] = typed and set(map(type, vals)) <= _NUMERIC
                (self.untyped.discard if typed else self.untyped.add)(c)
            cells, n, ascii_only = self._cells(vals)
            plain = plain and ascii_only
            self.natural[c] = max(n, self.natural[c])
            batch.append(max(n, _width(c)))
            columns.append(cells)
            word = 0
            if self.width is not None and (c in ELIDE or self._wraps(c, self.natural[c])):
                word = max((longest_word(x) for x in cells if len(x) > MIN_WRAP), default=0)
                self.word[c] = max(word, self.word.get(c, 0))
            bword.append(word)
        present, columns, widths, wrap, bands = self._choose(present, columns, batch, bword)
        new_cols = present != self.shown
        relayout = widths != self.widths or bands != self.bands
        self.shown, self.widths, self.wrap, self.bands = present, widths, wrap, bands
        parts = []
        if self.headers == 0 or new_cols or (relayout and self.width is not None):
            parts.append(self._header())
        right = [self.numeric[c] for c in present]
        if bands is not None:
            parts.extend(self._banded(row, right) for row in zip(*columns))
            self.out.write("".join(parts))
            return
        # one format call per plain row; a cell wider than its column (a later, longer id)
        # pushes the rest of its line rather than being cut
        specs = [("{:>%d}" if r else "{:<%d}") % w for r, w in zip(right, widths)]
        if not right[-1]:
            specs[-1] = "{}"   # no trailing blanks
        line_fmt = SEP.join(specs) + "\n"
        folding = [j for j, f in enumerate(wrap) if f]
        long_rows: set[int] = set()
        for j in folding:
            w = widths[j]
            long_rows.update(i for i, x in enumerate(columns[j]) if len(x) > w and _width(x) > w)
        for i, row in enumerate(zip(*columns)):
            if i in long_rows:
                parts.append(self._folded(row, present, widths, wrap, right))
            elif plain and self.width is None:
                parts.append(line_fmt.format(*row))
            elif plain:   # a terminal: no trailing blanks (they could wrap into an empty line)
                parts.append(line_fmt.format(*row).rstrip() + "\n")
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

    def _banded(self, row, right) -> str:
        """One row over its bands: the first line(s) as usual, then each band that has a
        value in this row, indented."""
        out = []
        for b, idx in enumerate(self.bands or []):   # (a banded layout)
            cells = [row[i] for i in idx]
            if b and not any(cells):
                continue
            text = self._folded(cells, [self.shown[i] for i in idx], [self.widths[i] for i in idx],
                                [self.wrap[i] for i in idx], [right[i] for i in idx])
            out.append(text if not b else "".join(INDENT + ln for ln in text.splitlines(True)))
        return "".join(out)

    @staticmethod
    def _folded(row, names, widths, wrap, right) -> str:
        pieces = [(_elide(s, w) if c in ELIDE else _fold(s, w)) if f and _width(s) > w else [s]
                  for c, s, w, f in zip(names, row, widths, wrap)]
        lines = []
        for k in range(max(map(len, pieces))):
            lines.append(TextTable._padded([p[k] if k < len(p) else "" for p in pieces], widths, right))
        return "".join(lines)

    def _header(self) -> str:
        tty = self.width is not None
        out = ""
        if self.headers == 0 and self.title:
            out += (f"\x1b[1m{self.title}\x1b[0m" if tty else self.title) + "\n"
        for b, idx in enumerate(self.bands or [range(len(self.shown))]):
            cells = []
            for i in idx:
                c, w = self.shown[i], self.widths[i]
                cells.append(c.rjust(w) if self.numeric[c] else c.ljust(w))
            line = (INDENT if b else "") + SEP.join(cells).rstrip()
            out += (f"\x1b[1m{line}\x1b[0m" if tty else line) + "\n"
        self.headers += 1
        return out
