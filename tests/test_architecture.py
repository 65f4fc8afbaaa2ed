"""The house rules of ARCHITECTURE.md that a grep can check: protocol/ is sans-IO outside
protocol/transport/, only replay/spark.py imports pyspark, only cli/ exits, and the
arrows point one way (protocol imports nothing of ours outside protocol)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
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
    bad = [str(p.relative_to(ROOT)) for folder in ("cli", "protocol", "replay") for p in _py(folder)
           if p.name != "spark.py" and any(m.split(".")[0] == "pyspark" for m in _imports(p))]
    assert bad == []


def test_only_cli_exits():
    bad = []
    for folder in ("protocol", "replay"):
        for path in _py(folder):
            text = path.read_text()
            if "sys.exit(" in text or "os._exit(" in text:
                bad.append(str(path.relative_to(ROOT)))
    assert bad == []
