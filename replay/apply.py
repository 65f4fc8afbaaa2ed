"""User code over captures (`replay --apply MODULE:FUNCTION`): finding the function (a module
in the working directory or on the path, or a file), grouping a table's frames the way both
engines do, and the local engine's run of it."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.protocol.errors import DcptoolError
from dcptool.replay.rules.columns import as_numpy, as_strings, equals
from dcptool.replay.store import reader


def load_function(spec: str) -> Callable:
    """The function named by `--apply`: `module:function` (the module found in the working
    directory first, as `python -m` does, then on the Python path) or `path/to/file.py:function`
    (a path with a `/` or ending in `.py`, relative to the working directory). Dotted
    function names (`module:Class.method`) are followed. ImportError, AttributeError or
    ValueError with a one-line message when it cannot be found."""
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise ValueError(f"--apply wants module:function or file.py:function, got {spec!r}")
    if module.endswith(".py") or os.sep in module or "/" in module:
        path = os.path.abspath(os.path.expanduser(module))
        if not os.path.isfile(path):
            raise ImportError(f"no such file {module}")
        name = os.path.splitext(os.path.basename(path))[0]
        if not name.isidentifier():
            raise ValueError(f"{os.path.basename(path)} is not a valid module name")
        loaded = sys.modules.get(name)
        if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") != path:
            raise ImportError(f"{module} would shadow the module {name!r} already loaded; rename the file")
        if loaded is None:
            # importable by its name, from its directory: Spark's workers import it so too
            # (replay/spark/engine.py ships the file), and cloudpickle refers to it by that name
            folder = os.path.dirname(path)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            loaded = importlib.import_module(name)
        fn = loaded
    else:
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)
        try:
            fn = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.split(".")[0] == exc.name.split(".")[0]:
                raise ImportError(f"no module named {exc.name!r} in the working directory "
                                  "or on the Python path") from None
            raise
    for part in attr.split("."):
        try:
            fn = getattr(fn, part)
        except AttributeError:
            raise AttributeError(f"{module} has no {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"{spec} is not callable")
    return fn


class ApplyError(DcptoolError):
    """The user's function raised (SystemExit included): one line naming it (exit 1)."""


APPLY_MARK = "[dcptool --apply] "   # begins the message of an ApplyError raised in a Spark worker


def function_name(fn) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}:{getattr(fn, '__qualname__', None) or repr(fn)}"


def call_user(fn: Callable, key, table: pa.Table):
    """`fn(key, table)`: what it prints goes to stderr (stdout carries the results), and what
    it raises, SystemExit included, becomes an ApplyError with its type and message."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return fn(key, table)
    except SystemExit as exc:
        raise ApplyError(f"{APPLY_MARK}{function_name(fn)} tried to exit (SystemExit {exc.code!r}): "
                         f"return a table or None instead (group {key!r})") from None
    except Exception as exc:  # noqa: BLE001 - the user's code may raise anything
        text = str(exc).strip().splitlines()
        raise ApplyError(f"{APPLY_MARK}{function_name(fn)} raised {type(exc).__name__}"
                         f"{': ' + text[0] if text else ''} (group {key!r})") from exc


def apply_error_text(exc: BaseException) -> str | None:
    """The ApplyError line inside an error (a Spark error quotes the worker's traceback), for
    one `dcptool:` line; None when there is none."""
    import re
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        m = re.search(re.escape(APPLY_MARK) + r"([^\n]*)", str(cur))
        if m:
            return "--apply " + m.group(1).strip()
        cur = cur.__cause__ or cur.__context__
    return None


def apply_group_key(protocol: str, t: pa.Table):
    """Group keys of `t` (rows of one group): vbucket for DCP, (stream, instance) for Synapse."""
    if protocol == "dcp":
        return t.column("vbucket")[0].as_py()
    return (as_strings(t.column("stream"))[0].as_py(), as_strings(t.column("instance"))[0].as_py())


def apply_sort_key(key):
    if isinstance(key, tuple):
        return tuple((v is not None, v or "") for v in key)
    return key


def apply_frames_mask(protocol: str, t: pa.Table) -> np.ndarray:
    """The frames user code sees: `in` frames of a vbucket (DCP) or a stream (Synapse)."""
    col = "vbucket" if protocol == "dcp" else "stream"
    return equals(t.column("direction"), "in") & as_numpy(t.column(col).is_valid(), dtype=bool)


def concat_results(results: list[tuple[object, pa.Table]]) -> pa.Table | None:
    results = sorted(results, key=lambda kv: apply_sort_key(kv[0]))
    tables = [r for _, r in results if r is not None]
    if not tables:
        return None
    return pa.concat_tables(tables, promote_options="default")


def apply_local(files: list, fn: Callable) -> pa.Table | None:
    protocol = reader.protocol_of(files)
    t = reader.read_capture_table(files)
    t = t.filter(pa.array(apply_frames_mask(protocol, t)))
    if protocol == "dcp":
        g = as_numpy(t.column("vbucket"), dtype=np.int64)
        order = np.argsort(g, kind="stable")
    else:
        s = pc.dictionary_encode(as_strings(t.column("stream")), null_encoding="encode")
        i = pc.dictionary_encode(as_strings(t.column("instance")), null_encoding="encode")
        g = as_numpy(s.indices, dtype=np.int64) * (len(i.dictionary) + 1) + as_numpy(i.indices, dtype=np.int64)
        order = np.argsort(g, kind="stable")
    t, g = t.take(order), g[order]
    bounds = np.flatnonzero(np.diff(g)) + 1 if len(g) else np.zeros(0, np.int64)
    results = []
    for s, e in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(g)]])):
        if e <= s:
            continue
        part = t.slice(int(s), int(e - s))
        key = apply_group_key(protocol, part)
        results.append((key, call_user(fn, key, part)))
    return concat_results(results)
