"""The documents in docs/ against the code: every command and every option a user can
type is on CLI.md, every document the README or a module points to exists, and the
README's commands name options that exist."""

from __future__ import annotations

import pathlib
import re

import click
import pytest

from dcptool.cli import COMMANDS, cli
from dcptool.cli.serve import SERVERS

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CLI_MD = (DOCS / "CLI.md").read_text()


def _commands():
    ctx = click.Context(cli)
    for name in COMMANDS:
        cmd = cli.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            sub_ctx = click.Context(cmd, parent=ctx)
            for sub in (SERVERS if name == "serve" else cmd.list_commands(sub_ctx)):
                yield f"{name} {sub}", cmd.get_command(sub_ctx, sub)
        else:
            yield name, cmd


def _section(title: str) -> str:
    """The text of CLI.md under the heading that names `dcptool TITLE`."""
    m = re.search(rf"^## `dcptool {re.escape(title)}[ `].*?$(.*?)(?=^## |\Z)", CLI_MD, re.M | re.S)
    assert m, f"docs/CLI.md has no section for `dcptool {title}`"
    return m.group(1)


COMMAND_LIST = list(_commands())


@pytest.mark.parametrize("name,cmd", COMMAND_LIST, ids=[n for n, _ in COMMAND_LIST])
def test_every_option_is_documented_in_its_section(name, cmd):
    section = _section(name)
    if name == "capture":   # capture shares stream's connection options table
        section += _section("stream")
    missing = []
    for param in cmd.params:
        if not isinstance(param, click.Option) or param.hidden:
            continue
        names = [o for o in param.opts + param.secondary_opts if o.startswith("--")]
        if names and not any(re.search(rf"`{re.escape(o)}[` =\\]", section) for o in names):
            missing.append("/".join(names))
    assert not missing, f"docs/CLI.md, `dcptool {name}`: undocumented {missing}"


def test_top_level_options_documented():
    for opt in ("--verbose", "--version", "--help"):
        assert f"`{opt}`" in CLI_MD


def test_documents_pointed_to_exist():
    for doc in ("CLI.md", "CAPTURE_FORMAT.md", "REPLAY.md", "ARCHITECTURE.md"):
        assert (DOCS / doc).is_file(), doc
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), f"README links to missing {link}"
    cited = set()
    for path in list(ROOT.glob("cli/*.py")) + list(ROOT.glob("protocol/**/*.py")) + list(ROOT.glob("replay/**/*.py")):
        cited.update(re.findall(r"\b([A-Z][A-Z_]+\.md)\b", path.read_text()))
    cited.discard("README.md")
    assert cited, "modules cite no documents: the check would be empty"
    for doc in cited:
        assert (DOCS / doc).is_file(), f"a module cites {doc}, which is not in docs/"


def test_readme_options_exist():
    """Every `dcptool CMD ... --opt` in the README's code blocks names a real option."""
    readme = (ROOT / "README.md").read_text()
    by_name = dict(COMMAND_LIST)
    checked = 0
    for block in re.findall(r"```sh\n(.*?)```", readme, re.S):
        for line in block.splitlines():
            m = re.search(r"dcptool (serve \w+|\w+)\b(.*)", line.split("#")[0].split("|")[0])
            if not m or m.group(1) not in by_name:
                continue
            cmd = by_name[m.group(1)]
            known = {o for p in cmd.params for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
            for opt in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)):
                assert opt in known or opt == "--help", f"README: `dcptool {m.group(1)}` has no {opt}"
                checked += 1
    assert checked > 10
