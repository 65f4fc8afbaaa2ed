"""The table of contents of docs/CLI.md: each command's section and the `###` sections under
it, then every other `##` section. `python scripts/cli_toc.py` rewrites the "Contents"
section in place (run it after adding or renaming a heading); tests/test_docs.py checks that
it is current."""

from __future__ import annotations

import pathlib
import re
import sys

CLI_MD = pathlib.Path(__file__).resolve().parent.parent / "docs" / "CLI.md"
START, END = "## Contents\n", "\n## "


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading (as tests/test_docs.py computes it)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(text: str) -> list[tuple[int, str, str]]:
    """(level, title, anchor) of each `##` and `###` heading outside code blocks, Contents left out."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = []
    for hashes, title in re.findall(r"^(#{1,6}) (.+?)\s*$", text, re.M):
        slug = _slug(title)
        anchor = f"{slug}-{seen[slug]}" if slug in seen else slug
        seen[slug] = seen.get(slug, 0) + 1
        if len(hashes) in (2, 3) and title != "Contents":
            out.append((len(hashes), title, anchor))
    return out


def contents(text: str) -> str:
    """The Contents section's list for the CLI.md `text`: the commands first, then the rest."""
    heads = _headings(text)
    commands, other = [], []
    group: list[str] | None = None
    for level, title, anchor in heads:
        link = f"[{title}](#{anchor})"
        if level == 2:
            group = commands if title.startswith("`dcptool ") else other
            group.append(f"- {link}")
        elif group is not None:
            group.append(f"  - {link}")
    return ("Commands:\n\n" + "\n".join(commands) + "\n\nEverything else:\n\n" + "\n".join(other) + "\n")


def rewrite(text: str) -> str:
    """`text` with its Contents section (made after the first paragraph when missing) current."""
    if START not in text:
        first = text.index("\n\n", text.index("\n\n") + 2) + 2
        text = text[:first] + START + "\n" + text[first:]
    head, _, rest = text.partition(START)
    body_end = rest.find(END)
    tail = rest[body_end:] if body_end >= 0 else ""
    fresh = head + START + "\n" + contents(text)
    return fresh + tail


if __name__ == "__main__":
    old = CLI_MD.read_text()
    new = rewrite(old)
    if new != old:
        CLI_MD.write_text(new)
    sys.exit(0)
