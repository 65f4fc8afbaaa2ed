"""The documents against the code: every command and every option a user can type is on
CLI.md, every document, link and anchor the README, CHANGELOG.md, docs/ or a module points
to exists, every `dcptool` command in the examples (README and docs/) names options that
exist, and the README stays a front door: small, the two set-up commands first, a link to
each command's section of CLI.md and to every document."""

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
README = ROOT / "README.md"
# every document a reader is sent to: where examples and links must hold
DOC_FILES = [README, ROOT / "CHANGELOG.md"] + sorted(DOCS.glob("*.md"))
README_MAX_BYTES = 12 * 1024


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


def _section_match(title: str) -> re.Match:
    m = re.search(rf"^## (`dcptool {re.escape(title)}[ `].*?)$(.*?)(?=^## |\Z)", CLI_MD, re.M | re.S)
    assert m, f"docs/CLI.md has no section for `dcptool {title}`"
    return m


def _section(title: str) -> str:
    """The text of CLI.md under the heading that names `dcptool TITLE`."""
    return _section_match(title).group(2)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _without_code(text: str) -> str:
    """The text with its fenced code blocks left out."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)


def _anchors(path: pathlib.Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", _without_code(path.read_text()), re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(path: pathlib.Path) -> list[str]:
    """The targets of a Markdown file's links, outside code blocks."""
    return re.findall(r"\]\(([^)\s]+)\)", _without_code(path.read_text()))


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
    for doc in ("CLI.md", "CAPTURE_FORMAT.md", "REPLAY.md", "ARCHITECTURE.md", "SERVE.md",
                "TESTING.md", "BENCHMARKS.md"):
        assert (DOCS / doc).is_file(), doc
    assert (ROOT / "CHANGELOG.md").is_file()
    readme_links = _links(README)
    assert any(link.startswith("docs/") for link in readme_links), "README links to no document"
    for path in DOC_FILES:
        name = path.relative_to(ROOT)
        for link in _links(path):
            if re.match(r"[a-z][a-z0-9+.-]*:", link):      # http:, mailto: ...: not ours to check
                continue
            target, _, anchor = link.partition("#")
            dest = (path.parent / target).resolve() if target else path
            assert dest.is_relative_to(ROOT), f"{name} links outside the repository: {link}"
            assert dest.exists(), f"{name} links to missing {link}"
            if anchor:
                assert dest.suffix == ".md" and anchor in _anchors(dest), \
                    f"{name} links to {link}: no such heading in {dest.relative_to(ROOT)}"
    cited = set()
    for path in list(ROOT.glob("cli/*.py")) + list(ROOT.glob("protocol/**/*.py")) + list(ROOT.glob("replay/**/*.py")):
        cited.update(re.findall(r"\b([A-Z][A-Z_]+\.md)\b", path.read_text()))
    cited.discard("README.md")
    assert cited, "modules cite no documents: the check would be empty"
    for doc in cited:
        assert (DOCS / doc).is_file(), f"a module cites {doc}, which is not in docs/"


def _example_commands(path: pathlib.Path):
    """Each `dcptool ...` command in a file's ```sh blocks: backslash-continued lines joined,
    comments dropped, and every command of a pipeline or `&&` / `;` chain on its own."""
    for block in re.findall(r"```sh\n(.*?)```", path.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"\|\|?|&&|;", line.split("#")[0]):
                m = re.search(r"\bdcptool (\S+(?: \w+)?)(.*)", part)
                if m:
                    yield m


def test_example_options_exist():
    """Every `dcptool CMD ... --opt` in the code blocks of the README and docs/ names a real
    command and a real option of it."""
    by_name = dict(COMMAND_LIST)
    groups = {name.split()[0] for name in by_name if " " in name}
    checked = {}
    for path in DOC_FILES:
        name = path.relative_to(ROOT)
        for m in _example_commands(path):
            words = m.group(1).split()
            cmd_name = " ".join(words) if words[0] in groups else words[0]
            rest = m.group(2) if words[0] in groups or len(words) == 1 else f" {words[1]}{m.group(2)}"
            assert cmd_name in by_name, f"{name}: `dcptool {cmd_name}` is not a command"
            cmd = by_name[cmd_name]
            known = {o for p in cmd.params for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
            for opt in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])\b", rest):
                assert opt in known or opt in ("--help", "-h"), f"{name}: `dcptool {cmd_name}` has no {opt}"
                checked[name] = checked.get(name, 0) + 1
    assert checked.get(pathlib.Path("README.md"), 0) > 10, "the README's examples name too few options"
    assert sum(checked.values()) > 100, checked


def test_readme_is_a_front_door():
    """The README is small, starts with exactly the two set-up commands, and sends readers on."""
    readme = README.read_text()
    size = len(readme.encode())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; at most {README_MAX_BYTES}"
    first = re.search(r"^```[^\n]*\n(.*?)^```", readme, re.M | re.S)
    assert first, "README.md has no code block"
    assert "\n## " not in readme[:first.start()], "the set-up commands are not at the top"
    commands = [line.split("#")[0].strip() for line in first.group(1).splitlines()]
    assert [c for c in commands if c] == ["make demo", "make test"], commands
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile has no {target} target"


def test_readme_links_each_command_to_its_section():
    links = set(_links(README))
    for name, _ in COMMAND_LIST:
        anchor = _slug(_section_match(name).group(1))
        assert f"docs/CLI.md#{anchor}" in links, f"README: no link to CLI.md's `dcptool {name}`"


def test_readme_lists_every_document():
    links = {link.partition("#")[0] for link in _links(README)}
    for doc in sorted(DOCS.glob("*.md")) + [ROOT / "CHANGELOG.md"]:
        assert str(doc.relative_to(ROOT)) in links, f"README does not point to {doc.relative_to(ROOT)}"


def _cli_toc():
    import importlib.util
    spec = importlib.util.spec_from_file_location("cli_toc", ROOT / "scripts" / "cli_toc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_md_contents_is_current():
    """Issue 39: CLI.md opens with a table of contents, per command; `python scripts/cli_toc.py`
    makes it current after a heading is added or renamed."""
    assert "\n## Contents\n" in CLI_MD[:2000]
    assert _cli_toc().rewrite(CLI_MD) == CLI_MD, "docs/CLI.md: Contents is stale: run python scripts/cli_toc.py"
    contents = CLI_MD.split("\n## Contents\n", 1)[1].split("\n## ", 1)[0]
    for name, _ in COMMAND_LIST:
        assert f"(#{_slug(_section_match(name).group(1))})" in contents, f"Contents: no `dcptool {name}`"


# option tables whose long cells are still to be split (sections other work of session 13
# rewrote at the same time); every other option cell is short enough to scan
LONG_CELLS_LEFT: set[str] = set()
OPTION_CELL_MAX = 200


def test_option_cells_are_short_enough_to_scan():
    """Issue 39: an option table's cells say what an option is in a line or two; the details
    follow the table."""
    long = []
    section = ""
    in_options = False
    for line in CLI_MD.splitlines():
        if line.startswith("## "):
            section = line[3:]
        if not line.startswith("|"):
            in_options = False
            continue
        if line.startswith("| option |"):
            in_options = True
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if not in_options or not cells or set(cells[0]) <= {"-"}:
            continue
        if len(cells[-1]) > OPTION_CELL_MAX and not any(s in section or s == cells[0] for s in LONG_CELLS_LEFT):
            long.append(f"{section}: {cells[0]} ({len(cells[-1])} characters)")
    assert not long, long
