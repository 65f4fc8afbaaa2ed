"""Several `dcptool` commands in ONE fresh Python process, one after another, each with its
own exit code, stdout and stderr, as if each were a subprocess of its own.

What it saves: the first command that needs Spark starts the JVM as a user's command does
(fresh process, fresh JVM, whatever the batch's environment and working directory are); the
later commands reuse that JVM (pyspark keeps its py4j gateway when a session stops, and the
next session is a new SparkContext on it), so each saves a Python start and a JVM start.
What is still each command's own: the session (master, confs, shuffle partitions), its
warnings and errors, pyspark's Python loggers and its exit code. Only the first command
shows what a JVM start does to stderr (log4j, py4j); put the one that pins that first. The
root logger (which -v configures) and the environment are put back after each command.

Descriptors 1 and 2 (not just sys.stdout / sys.stderr) point at the command's files while
it runs, so anything the process writes there (pyspark's loggers, a stray print) lands in
that command's output; everything is read after the whole batch ended, so the first
command's files also hold whatever the JVM it started wrote to its inherited stdout later.

Used as `run_batch([Call(argv), ...], env=, cwd=)`; the child is `python -m
tests.support.cli_batch REQUEST.json` (docs/TESTING.md, "Fresh Spark processes, shared")."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from tests.support.paths import ROOT


@dataclass
class Call:
    """One `dcptool ARGV` command; `env` changes the environment for it alone (None removes
    a variable)."""
    argv: list[str]
    env: dict[str, str | None] = field(default_factory=dict)


@dataclass
class Ran:
    """What a command did, as subprocess.CompletedProcess says it."""
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float   # its wall time in the batch (the first one's includes the JVM start)


def run_batch(calls: list[Call], env: dict | None = None, cwd: str | None = None,
              timeout: float = 600) -> list[Ran]:
    """Run `calls` in order in one fresh process (environment `env`, else os.environ;
    working directory `cwd`): what each did. The batch's own files live in a temporary
    directory of their own, never in `cwd`."""
    full = dict(os.environ if env is None else env)
    full["PYTHONPATH"] = str(ROOT) + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="dcptool-cli-batch-") as work:
        request = os.path.join(work, "request.json")
        with open(request, "w") as f:
            json.dump({"dir": work, "calls": [{"argv": c.argv, "env": c.env} for c in calls]}, f)
        proc = subprocess.run([sys.executable, "-m", "tests.support.cli_batch", request], env=full, cwd=cwd,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"the batch process failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        with open(os.path.join(work, "codes.json")) as f:
            done = json.load(f)
        return [Ran(c.argv, code, _read(work, i, "out"), _read(work, i, "err"), seconds)
                for i, (c, (code, seconds)) in enumerate(zip(calls, done))]


def _read(work: str, i: int, kind: str) -> str:
    with open(os.path.join(work, f"{i}.{kind}"), errors="replace") as f:
        return f.read()


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _run_one(main, work: str, i: int, call: dict) -> int:
    """One command with descriptors 1 and 2 on its own files and its environment changes."""
    saved_env = {k: os.environ.get(k) for k in call["env"]}
    for k, v in call["env"].items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    root = logging.getLogger()
    saved_logging = list(root.handlers), root.level
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    for fd, kind in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(work, f"{i}.{kind}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    try:
        main(call["argv"])
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        root.handlers[:] = saved_logging[0]   # -v's logging.basicConfig undone
        root.setLevel(saved_logging[1])
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return code


def _child(request_path: str) -> None:
    with open(request_path) as f:
        request = json.load(f)
    from dcptool.cli import main
    done = []
    for i, call in enumerate(request["calls"]):
        t0 = time.monotonic()
        code = _run_one(main, request["dir"], i, call)
        done.append((code, time.monotonic() - t0))
    with open(os.path.join(request["dir"], "codes.json"), "w") as f:
        json.dump(done, f)


if __name__ == "__main__":
    _child(sys.argv[1])
