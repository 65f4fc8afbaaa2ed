"""The CLI as a whole: every command has help and is in the README; --help and --version
work and start without pyarrow, numpy or pyspark."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from dcptool.cli import COMMANDS, cli
from dcptool.cli.serve import SERVERS
from tests.support.paths import ROOT


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_has_help_and_is_in_readme(name):
    res = CliRunner().invoke(cli, [name, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage:" in res.output
    assert f"dcptool {name}" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", list(SERVERS))
def test_every_server_has_help_and_is_in_readme(name):
    res = CliRunner().invoke(cli, ["serve", name, "--help"])
    assert res.exit_code == 0, res.output
    assert f"dcptool serve {name}" in (ROOT / "README.md").read_text()


def test_top_level_help_lists_every_command():
    res = CliRunner().invoke(cli, ["--help"])
    assert res.exit_code == 0
    for name in COMMANDS:
        assert name in res.output


def test_help_imports_no_heavy_modules():
    code = ("import sys; from dcptool.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in ('pyarrow', 'numpy', 'pyspark', 'rich') if m in sys.modules]\n"
            "sys.stderr.write('HEAVY:' + ','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "Commands:" in out.stdout
    assert out.stderr.strip().endswith("HEAVY:")


def test_version_and_module_entry():
    out = subprocess.run([sys.executable, "-m", "dcptool.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("dcptool, version ")


def test_unknown_scheme_is_a_usage_error():
    res = CliRunner().invoke(cli, ["stream", "http://x/y"])
    assert res.exit_code == 2 and "unknown scheme" in res.output


def test_password_in_url_is_refused():
    res = CliRunner().invoke(cli, ["stream", "couchbase://u:secret@127.0.0.1/b"])
    assert res.exit_code == 2 and "password in the URL is refused" in res.output
    assert "secret" not in res.output


def test_error_line_without_file_descriptors_is_still_one_line():
    """No descriptor left (EMFILE) when the error is printed: rich cannot be imported, the one
    line is written plainly, no traceback, the exit code kept (was a traceback)."""
    code = ("import errno, sys\n"
            "class NoFd:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'rich' or name.startswith('rich.'):\n"
            "            raise OSError(errno.EMFILE, 'Too many open files')\n"
            "sys.meta_path.insert(0, NoFd())\n"
            "from dcptool.cli import main\n"
            "main(['replay', '/nonexistent/capture'])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert p.stderr == "dcptool: /nonexistent/capture: no such file or directory\n", p.stderr
