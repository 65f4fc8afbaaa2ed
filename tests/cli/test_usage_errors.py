"""Issue 39, finding 8: a usage error is one line saying what is wrong plus one hint line, exit
2, for every command (click's own form was four lines: Usage, Try, a blank line, Error), and
`replay --help` lists every table of both protocols."""

from __future__ import annotations

import subprocess

import pytest
from click.testing import CliRunner

from dcptool.cli import COMMANDS, cli
from dcptool.cli.serve import SERVERS
from dcptool.replay.rules.table_types import TABLE_NAMES
from tests.support.paths import DCPTOOL, ROOT

_SPARK = ("start", "stop", "status")
_EVERY = [[name] for name in COMMANDS if name not in ("serve", "spark")] + \
    [["serve", s] for s in SERVERS] + [["spark", s] for s in _SPARK]


def _usage(argv: list[str]) -> list[str]:
    res = CliRunner().invoke(cli, argv, prog_name="dcptool")
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert res.stdout == "", res.stdout          # stdout carries only data
    return res.stderr.splitlines()


@pytest.mark.parametrize("command", _EVERY, ids=" ".join)
def test_unknown_option_is_one_line_and_a_hint(command):
    lines = _usage([*command, "--no-such-option"])
    assert len(lines) == 2, lines
    assert lines[0].startswith("dcptool: No such option '--no-such-option'"), lines
    assert lines[1] == f"Try 'dcptool {' '.join(command)} -h' for help.", lines


@pytest.mark.parametrize("argv, first, hint", [
    (["no-such-command"], "dcptool: No such command 'no-such-command'.", "dcptool -h"),
    (["--no-such-option"], "dcptool: No such option '--no-such-option'", "dcptool -h"),
    (["serve", "nope"], "dcptool: No such command 'nope'.", "dcptool serve -h"),
    (["replay"], "dcptool: Missing argument 'CAPTURES...'.", "dcptool replay -h"),
    (["serve", "dcp", "--port", "x"], "dcptool: Invalid value for '--port'", "dcptool serve dcp -h"),
    # raised by the command's own code, not by click's parser
    (["replay", "caps", "--conf", "novalue"], "dcptool: --conf wants KEY=VALUE", "dcptool replay -h"),
])
def test_usage_error_forms(argv, first, hint):
    lines = _usage(argv)
    assert len(lines) == 2 and lines[0].startswith(first) and lines[1] == f"Try '{hint}' for help.", lines


def test_group_without_subcommand_still_shows_its_help():
    res = CliRunner().invoke(cli, ["serve"])
    assert "Servers:" in res.output and "dcp" in res.output


def test_real_process_prints_two_lines():
    r = subprocess.run([DCPTOOL, "diff", "--bogus"], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and r.stdout == "", r
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("dcptool: No such option '--bogus'"), r.stderr
    assert lines[1] == "Try 'dcptool diff -h' for help.", r.stderr


def test_readme_promises_the_two_lines():
    readme = (ROOT / "README.md").read_text()
    assert "Try 'dcptool COMMAND -h' for help." in readme


def test_replay_help_lists_every_table():
    res = CliRunner().invoke(cli, ["replay", "-h"], terminal_width=80)
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    dcp = text.split("DCP tables:", 1)[1].split("Synapse tables:", 1)[0].split()
    synapse = text.split("Synapse tables:", 1)[1].split("Examples:", 1)[0].split()
    assert dcp == list(TABLE_NAMES["dcp"]) and synapse == list(TABLE_NAMES["synapse"]), (dcp, synapse)
    assert {"history", "topology", "lag"} <= set(dcp)
    assert max(len(line) for line in res.output.split("Examples:")[0].splitlines()) <= 80
