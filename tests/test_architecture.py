"""The house rules of ARCHITECTURE.md that a grep can check: protocol/ is sans-IO outside
protocol/transport/, only replay/spark/engine.py imports pyspark, only cli/ exits, and the
arrows point one way (protocol imports nothing of ours outside protocol)."""

from __future__ import annotations

import ast
import pathlib

from tests.support.paths import ROOT

# the top-level folders of our code, each installed as dcptool.<folder> (pyproject.toml)
CODE_FOLDERS = ("cli", "protocol", "replay", "capture", "live", "serve", "restore")
IO_MODULES = {"socket", "asyncio", "click", "rich", "pyarrow", "pyspark", "redis", "ssl", "selectors"}


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _py(folder):
    return sorted((ROOT / folder).rglob("*.py"))


def test_protocol_is_sans_io_outside_transport():
    bad = []
    for path in _py("protocol"):
        if "transport" in path.relative_to(ROOT).parts:
            continue
        for mod in _imports(path):
            if mod.split(".")[0] in IO_MODULES:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert bad == []


def test_protocol_depends_on_nothing_of_ours_but_protocol():
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in _py("protocol") for m in _imports(p)
           if m.startswith("dcptool.") and not m.startswith("dcptool.protocol")]
    assert bad == []


def test_replay_uses_only_protocol_codecs_not_cli():
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in _py("replay") for m in _imports(p)
           if m.startswith("dcptool.cli") or m.startswith("dcptool.protocol.transport")]
    assert bad == []


def test_only_replay_spark_imports_pyspark():
    bad = [str(p.relative_to(ROOT)) for folder in CODE_FOLDERS for p in _py(folder)
           if p.relative_to(ROOT).as_posix() != "replay/spark/engine.py"
           and any(m.split(".")[0] == "pyspark" for m in _imports(p))]
    assert bad == []


def test_the_dcp_wire_imports_neither_client_nor_server():
    sides = ("dcptool.protocol.dcp.client", "dcptool.protocol.dcp.server")
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in _py("protocol/dcp/wire") for m in _imports(p)
           if m.startswith(sides)]
    assert _py("protocol/dcp/wire") and bad == []


def test_the_dcp_client_does_not_import_the_server():
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in _py("protocol/dcp/client") for m in _imports(p)
           if m.startswith("dcptool.protocol.dcp.server")]
    assert _py("protocol/dcp/client") and bad == []


def test_no_code_folder_is_a_flat_list_of_more_than_20_modules():
    folders = {p.parent for folder in CODE_FOLDERS for p in _py(folder)}
    big = {str(f.relative_to(ROOT)): n for f in folders
           if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > 20}
    assert len(folders) > 10 and big == {}


def test_only_cli_exits():
    bad = []
    for folder in ("protocol", "replay", "capture", "live", "serve", "restore"):
        for path in _py(folder):
            text = path.read_text()
            if "sys.exit(" in text or "os._exit(" in text:
                bad.append(str(path.relative_to(ROOT)))
    assert bad == []


# ---- the rooms of docs/ARCHITECTURE.md: the capture store below the engines, no circles,
# ---- and no reaching into another package's private names

def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["dcptool", *parts])


def _our_modules() -> dict[str, pathlib.Path]:
    mods = {}
    for folder in CODE_FOLDERS:
        for p in _py(folder):
            mods[_module_name(p)] = p
    return mods


def _edges(path: pathlib.Path, mods: dict) -> set[str]:
    """The modules of ours that `path` imports (module level or inside functions)."""
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in mods:
                out.add(node.module)
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in mods:
                    out.add(sub)
    me = _module_name(path)
    # importing a submodule also runs its packages' __init__, which import nothing of ours
    return {m for m in out if m != me}


def test_no_import_cycles():
    mods = _our_modules()
    graph = {m: _edges(p, mods) for m, p in mods.items()}
    assert sum(len(v) for v in graph.values()) > 50, "the import graph is empty: the check would be empty"
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_store_never_imports_an_engine():
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in _py("replay/store") for m in _imports(p)
           if m.startswith("dcptool.") and not m.startswith(("dcptool.replay.store", "dcptool.protocol"))]
    assert _py("replay/store") and bad == []


def _private_reach_ins(source: str, me: str) -> list[str]:
    """`from other_module import _name`, and `alias._name` where alias is a module or a name
    imported from another of our modules (dunders are not private); `me` is the module."""
    tree = ast.parse(source, me)
    bad, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("dcptool.") and node.module != me:
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    bad.append(f"from {node.module} import {a.name}")
                aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            aliases.update(a.asname or a.name.split(".")[0] for a in node.names
                           if a.name.startswith("dcptool.") and a.name != me)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and isinstance(node.value, ast.Name) and node.value.id in aliases:
            bad.append(f"{node.value.id}.{node.attr}")
    return bad


# private names of another module used in cli/ or replay/ when issue 23 started (their
# owners are reorganising those rooms); this list only shrinks
KNOWN_REACH_INS: dict[str, list[str]] = {}


def test_no_private_name_of_another_module_is_used():
    found = {str(p.relative_to(ROOT)): bad for folder in CODE_FOLDERS for p in _py(folder)
             if (bad := _private_reach_ins(p.read_text(), _module_name(p)))}
    assert {k: v for k, v in found.items() if KNOWN_REACH_INS.get(k) != v} == {}
    assert sorted(set(KNOWN_REACH_INS) - set(found)) == []


def test_the_reach_in_check_sees_both_forms():
    text = ("from dcptool.protocol.dcp.wire.constants import _secret, Opcode\n"
            "from dcptool.protocol.dcp.wire import messages as m\n"
            "import dcptool.protocol.errors as errors\n"
            "x = m._generic(1) or Opcode._member_map_ or m.__name__ or errors._x or self._mine\n")
    assert sorted(_private_reach_ins(text, "dcptool.protocol.probe")) == [
        "Opcode._member_map_", "errors._x", "from dcptool.protocol.dcp.wire.constants import _secret", "m._generic"]
    # a module's own names are its own
    assert sorted(_private_reach_ins(text, "dcptool.protocol.dcp.wire.constants")) == ["errors._x", "m._generic"]


def test_protocol_uses_no_private_attribute_of_another_object():
    """In protocol/, `x._name` is only ever self's or cls's: another object's state is reached
    through its public methods (no `conn._out`, `vb._encoded`, `proto._flush()`)."""
    bad = []
    for p in _py("protocol"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []


# ---- one room, one job: no function over 100 lines

MAX_FUNCTION_LINES = 100
# functions outside protocol/ over the limit when issue 23 started: being split (by their
# owners in cli/ and replay/); remove a name once its function is split, never add one
BEING_SPLIT: set[str] = set()


def _functions(path: pathlib.Path):
    """(qualified name, node) of every function and method in path."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(ast.parse(path.read_text(), str(path)), "")


def test_no_function_is_over_100_lines():
    long = {f"{p.relative_to(ROOT).as_posix()}:{name}": fn.end_lineno - fn.lineno + 1
            for folder in CODE_FOLDERS for p in _py(folder)
            for name, fn in _functions(p) if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES}
    assert {k: n for k, n in long.items() if k not in BEING_SPLIT} == {}


# ---- constants as data: opcodes are named (Opcode.X), not written as numbers

def _named_op(node) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "op" in name.lower().replace("opaque", "").replace("option", "")


def _int_literals(node) -> list[int]:
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [e.value for e in elts if isinstance(e, ast.Constant) and type(e.value) is int]


def _opcode_literal_comparisons(source: str, label: str) -> list[str]:
    """Comparisons of an op / opcode name with an int literal (or a tuple of them) >= 0x01."""
    found = []
    for node in ast.walk(ast.parse(source, label)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_named_op(s) for s in sides) and any(v >= 0x01 for s in sides for v in _int_literals(s)):
                found.append(f"{label}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_few_opcode_comparisons_with_literals_remain_in_protocol():
    found = [c for p in _py("protocol") for c in _opcode_literal_comparisons(p.read_text(), str(p.relative_to(ROOT)))]
    assert len(found) <= 5, found


def test_the_opcode_check_finds_a_literal_comparison():
    probe = "def f(msg, op, opaque):\n    return msg.op_code == 0x5C or op in (0x62, 0x63) or op == Opcode.X or opaque == 7\n"
    assert len(_opcode_literal_comparisons(probe, "probe")) == 2


def test_message_classes_name_their_opcode():
    path = ROOT / "protocol" / "dcp" / "wire" / "message_types.py"
    literal = [f"line {n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
               if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == "OPCODE"
               and isinstance(n.value, ast.Constant) and n.value.value != -1]
    named = [n for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == "OPCODE"
             and isinstance(n.value, ast.Attribute)]
    assert literal == [] and len(named) > 20


# ---- capture/: the library under the CLI (capture a source into a directory, no click),
# ---- and one exception base for the whole project

def test_capture_imports_protocol_and_the_store_never_cli_click_or_rich():
    allowed = ("dcptool.capture", "dcptool.protocol", "dcptool.replay.store", "dcptool.replay.timestamps",
               "dcptool.replay.tuning")
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in _py("capture") for m in _imports(p)
           if (m.startswith("dcptool.") and not m.startswith(allowed)) or m.split(".")[0] in ("click", "rich")]
    assert _py("capture") and bad == []


def test_restore_imports_replay_and_protocol_never_cli_capture_click_or_rich():
    """cli -> restore -> replay, protocol: the restore library is below the CLI, beside capture."""
    allowed = ("dcptool.restore", "dcptool.protocol", "dcptool.replay")
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in _py("restore") for m in _imports(p)
           if (m.startswith("dcptool.") and not m.startswith(allowed)) or m.split(".")[0] in ("click", "rich")]
    assert _py("restore") and bad == []
    below = [f"{p.relative_to(ROOT)} imports {m}" for folder in ("protocol", "replay", "capture") for p in _py(folder)
             for m in _imports(p) if m.startswith("dcptool.restore")]
    assert below == []


def test_nothing_below_the_cli_imports_capture():
    bad = [f"{p.relative_to(ROOT)} imports {m}" for folder in ("protocol", "replay") for p in _py(folder)
           for m in _imports(p) if m.startswith("dcptool.capture")]
    assert bad == []


def test_capture_holds_the_capture_pipeline_only():
    """Issue 35: every module of capture/ is part of capturing a source, reached from
    `capture()` (capture/__init__.py, through capture/'s own imports) or from the pcap
    import and export (capture/pcap/); what only the CLI uses lives in cli/, live/ or serve/."""
    mods = _our_modules()
    inside = {m for m in mods if m == "dcptool.capture" or m.startswith("dcptool.capture.")}
    graph = {m: _edges(mods[m], mods) & inside for m in inside}
    seen, todo = set(), ["dcptool.capture", *(m for m in inside if m.startswith("dcptool.capture.pcap"))]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    assert len(inside) > 10 and sorted(inside - seen) == []


def test_live_and_serve_sit_below_the_cli():
    """live/ (what a live run shows) and serve/ (running serve's servers) use capture/,
    replay/ and protocol/, never cli/, click or rich; nothing below the CLI imports them."""
    bad = [f"{p.relative_to(ROOT)} imports {m}" for folder in ("live", "serve") for p in _py(folder)
           for m in _imports(p) if m.startswith("dcptool.cli") or m.split(".")[0] in ("click", "rich")]
    bad += [f"{p.relative_to(ROOT)} imports {m}" for folder in ("protocol", "replay", "capture") for p in _py(folder)
            for m in _imports(p) if m.startswith(("dcptool.live", "dcptool.serve"))]
    assert _py("live") and _py("serve") and bad == []


def _exception_classes():
    """Every exception class defined in a module of ours (each module imported)."""
    import importlib
    import inspect
    found = []
    for name in sorted(_our_modules()):
        if name.endswith("__main__"):
            continue
        mod = importlib.import_module(name)
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if obj.__module__ == name and issubclass(obj, BaseException):
                found.append(obj)
    return found


def test_every_exception_class_derives_from_the_one_base():
    from dcptool.protocol.errors import DcptoolError
    classes = _exception_classes()
    names = {c.__name__ for c in classes}
    assert {"ProtocolError", "WriterError", "CaptureError", "VerifyError", "PlaybackError"} <= names
    bad = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, DcptoolError)]
    assert bad == []


def test_exit_codes_come_from_one_table():
    from dcptool.cli import exit_codes
    from dcptool.protocol import errors as perr
    assert exit_codes.exit_code_for(perr.LateUsageError("x")) == exit_codes.EXIT_USAGE
    assert exit_codes.exit_code_for(perr.ConnectFailed("x")) == exit_codes.EXIT_CONNECT
    assert exit_codes.exit_code_for(perr.AuthRefused("x")) == exit_codes.EXIT_AUTH
    assert exit_codes.exit_code_for(perr.RemoteError(perr.ErrorCode.BAD_MAGIC, "x")) == exit_codes.EXIT_PROTOCOL
    assert exit_codes.exit_code_for(perr.RemoteError(perr.ErrorCode.STATUS, "x", status=0x24)) == exit_codes.EXIT_AUTH
    assert exit_codes.exit_code_for(perr.Interrupted(15)) == 143
    assert exit_codes.exit_code_for(perr.DcptoolError("x")) == exit_codes.EXIT_RUNTIME
    assert [c for c, _ in exit_codes.EXIT_CODES][-1] is perr.DcptoolError


def _test_imports(path: pathlib.Path):
    """(line, module) of every `tests.*` import in a file; `from tests.x import test_y` names
    tests.x.test_y."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("tests."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tests."):
            test_names = [a.name for a in node.names if a.name.startswith("test_") or a.name == "conftest"]
            yield node.lineno, f"{node.module}.{test_names[0]}" if test_names else node.module


def test_no_test_module_imports_another_test_module():
    """Shared helpers live in tests/support/; a test file (or conftest) is never imported."""
    bad = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p in _py("tests") for line, m in _test_imports(p)
           if any(part.startswith("test_") or part == "conftest" for part in m.split(".")[1:])]
    assert _py("tests/support") and bad == []


def test_the_cli_is_a_thin_layer_of_at_most_3600_lines():
    """Issue 23: cli/ parses options, calls library code and prints (model: sqlite-utils' cli.py);
    library logic lives in capture/, restore/, replay/ or protocol/. `cat cli/*.py cli/*/*.py | wc -l`."""
    files = sorted((ROOT / "cli").glob("*.py")) + sorted((ROOT / "cli").glob("*/*.py"))
    lines = sum(len(p.read_bytes().splitlines()) for p in files)
    assert len(files) > 20 and lines <= 3600, f"cli/ holds {lines} lines"


def test_replay_cli_is_options_a_library_call_and_printing():
    """Issue 35: `dcptool replay` parses options, calls replay/run.py's `replay()` and prints; the
    engine choice, the SQL fences and the Spark session live behind that call."""
    path = ROOT / "cli" / "replay.py"
    engines = [m for m in _imports(path) if m.startswith(("dcptool.replay.local", "dcptool.replay.spark"))]
    assert engines == [] and "dcptool.replay.run" in set(_imports(path))
    assert len(path.read_bytes().splitlines()) <= 200


def test_the_engines_share_only_through_neutral_modules():
    """replay/local (DuckDB) and replay/spark never import each other: what both use (the SQL
    errors: replay/sql_common.py) lives beside them."""
    pairs = (("replay/local", "dcptool.replay.spark"), ("replay/spark", "dcptool.replay.local"))
    bad = [f"{p.relative_to(ROOT)} imports {m}" for folder, other in pairs for p in _py(folder)
           for m in _imports(p) if m.startswith(other)]
    assert _py("replay/local") and _py("replay/spark") and bad == []
# ---- the DCP consumer (issue 35): a few parts that each own their state, held together by a
# ---- Consumer that offers what a caller needs

CLIENT = "protocol/dcp/client"
# methods that change the container they are called on
MUTATORS = frozenset({"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault",
                      "add", "discard", "sort", "reverse", "__setitem__", "__delitem__"})


def _consumer_parts() -> tuple[set[str], set[str]]:
    """(the classes of the consumer's parts, the attribute names that hold a part). The parts
    are the classes Consumer.__init__ builds; an attribute holds a part when an __init__ of a
    client module sets it to a part built there or to a parameter annotated with a part's class."""
    trees = [ast.parse(p.read_text(), str(p)) for p in _py(CLIENT)]
    classes: set[str] = set()
    for tree in trees:
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef) and cls.name == "Consumer":
                init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
                classes |= {n.value.func.id for n in ast.walk(init) if isinstance(n, ast.Assign)
                            and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)}
    attrs: set[str] = set()
    for tree in trees:
        for init in ast.walk(tree):
            if not (isinstance(init, ast.FunctionDef) and init.name == "__init__"):
                continue
            typed = {a.arg for a in init.args.args if a.annotation is not None
                     and ast.unparse(a.annotation).strip("'\"") in classes}
            for n in ast.walk(init):
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Attribute) \
                        and isinstance(n.targets[0].value, ast.Name) and n.targets[0].value.id == "self" \
                        and ((isinstance(n.value, ast.Name) and n.value.id in typed)
                             or (isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
                                 and n.value.func.id in classes)):
                    attrs.add(n.targets[0].attr)
    return classes, attrs


def _foreign_writes(source: str, label: str, classes: set[str], attrs: set[str]) -> list[str]:
    """Where a function changes a field of another part: `part.field = ...`, `part.field[k] = ...`,
    `del part.field[k]`, `part.field.pop(...)` (any MUTATORS method), also through a local name
    bound to a part (`streams = self.streams`) or to a part's field (`last = streams.last`,
    `st = self.streams.states[k]`). A part is `self.<attr>` for an attribute that holds one, a
    parameter annotated with a part's class, or a local name bound to either; `self` is not."""
    found = []
    for fn in ast.walk(ast.parse(source, label)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        part_names = {a.arg for a in fn.args.args if a.annotation is not None
                      and ast.unparse(a.annotation).strip("'\"") in classes}
        field_names: set[str] = set()

        def is_part(e: ast.expr) -> bool:
            return (isinstance(e, ast.Name) and e.id in part_names) or (
                isinstance(e, ast.Attribute) and e.attr in attrs and isinstance(e.value, ast.Name)
                and e.value.id == "self")

        def is_field(e: ast.expr) -> bool:
            """A part's field, an item of one, or a local name bound to one of those."""
            while isinstance(e, ast.Subscript):
                e = e.value
            if isinstance(e, ast.Name):
                return e.id in field_names
            return isinstance(e, ast.Attribute) and (is_part(e.value) or is_field(e.value)) and not is_part(e)

        def bind(target: ast.expr, value: ast.expr) -> None:
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                for t, v in zip(target.elts, value.elts):
                    bind(t, v)
            elif isinstance(target, ast.Name):
                if is_part(value):
                    part_names.add(target.id)
                elif is_field(value):
                    field_names.add(target.id)

        def changed(t: ast.expr) -> bool:
            if isinstance(t, ast.Attribute):
                return is_part(t.value) or is_field(t.value)
            if isinstance(t, ast.Subscript):
                return is_field(t.value)
            if isinstance(t, ast.Tuple):
                return any(changed(e) for e in t.elts)
            return False

        # in source order, so that a name is bound before it is used
        for node in sorted((n for n in ast.walk(fn) if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset)):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in MUTATORS and is_field(node.func.value):
                found.append(f"{label}:{node.lineno}: {ast.unparse(node)}")
            bad = [t for t in targets if changed(t)]
            if bad:
                found.append(f"{label}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    bind(t, node.value)
    return found


def test_no_part_of_the_consumer_changes_another_parts_field():
    """A part changes its own fields only, through its own methods: no `self.link.cfg = ...`,
    `self.receiver.unacked = 0`, `self.link.pending.pop(...)`, `exact = self.streams.exact;
    exact[k] = -1` in protocol/dcp/client."""
    classes, attrs = _consumer_parts()
    assert {"Link", "Handshake", "Streams", "Receiver"} <= classes, classes
    assert {"link", "handshake", "streams", "receiver"} <= attrs, attrs
    found = [w for p in _py(CLIENT) for w in _foreign_writes(p.read_text(), str(p.relative_to(ROOT)), classes, attrs)]
    assert found == []


def test_the_part_check_sees_every_form_of_a_write():
    probe = '''
class Consumer:
    def __init__(self, cfg):
        self.link = Link(cfg)
        self.streams = Streams(self.link)

    def route(self, cfg):
        self.link.cfg = cfg                      # 1 a field replaced
        self.link.pending.pop(3, None)           # 2 a field's container changed
        self.streams.exact[4] = -1               # 3 an item of a field
        self.link.clock += 1                     # 4 augmented
        self.link.send(b"x")                     # the part's own method: fine
        self.mine = self.streams.last[0]         # reading: fine

class Receiver:
    def __init__(self, link: Link, streams: "Streams"):
        self.link = link
        self.streams = streams
        self.count = 0

    def receive(self, k):
        streams = self.streams
        last, own = streams.last, self.count
        last[k] = 5                              # 5 through a local name
        st = streams.states[k]
        st.last_seqno = 6                        # 6 a record in a part's table
        del streams.oso[k]                       # 7 deleted
        own += 1                                 # a local: fine
        self.count = own                         # its own field: fine

def helper(link: Link):
    link.out.append(b"")                         # 8 a parameter annotated with a part's class
'''
    classes, attrs = _consumer_parts()
    found = _foreign_writes(probe, "probe", classes | {"Link", "Streams"}, attrs | {"link", "streams"})
    assert sorted(int(f.split(":")[1]) for f in found) == [8, 9, 10, 11, 24, 26, 27, 32], found


def test_the_consumer_offers_at_most_25_public_names():
    """Consumer keeps what a caller needs; the rest is a part's (consumer.handshake.features,
    consumer.streams.vb_states(), consumer.receiver.data_frames, consumer.polls.request())."""
    from dcptool.protocol.dcp.client.consumer import Consumer, ConsumerConfig
    public = sorted(n for n in dir(Consumer(ConsumerConfig(bucket="b", name="n"))) if not n.startswith("_"))
    assert {"link", "handshake", "streams", "receiver", "start", "receive", "outgoing"} <= set(public)
    assert len(public) <= 25, public


def test_the_consumer_phases_are_enums_with_one_table_each():
    from dcptool.protocol.dcp.client import phases
    assert set(phases.CONN_MOVES) == set(phases.ConnPhase) and set(phases.STREAM_MOVES) == set(phases.StreamPhase)
    # every phase but the first is reached by some move
    assert {p for to in phases.CONN_MOVES.values() for p in to} == set(phases.ConnPhase) - {phases.ConnPhase.HELLO}
    assert {p for to in phases.STREAM_MOVES.values() for p in to} == set(phases.StreamPhase)
    for path in (ROOT / CLIENT / "handshake.py", ROOT / CLIENT / "streams.py"):
        text = path.read_text()
        assert "self.phase = " not in text.replace("self.phase = ConnPhase.HELLO", "").replace(
            "self.phase = move(", "")
        assert "range(5)" not in text
