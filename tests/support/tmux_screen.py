"""A command run on a real terminal of a fixed size: a tmux server of its own (a unique
socket, no user configuration), one pane of WIDTH x HEIGHT that stays after the command
ends, read back with `capture-pane -p` as the lines the terminal shows (a line the terminal
wrapped is two lines there, as a person sees it). The server is always killed."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid

TMUX = shutil.which("tmux") or "/usr/bin/tmux"
END = "__dcptool_test_end__"


def available() -> bool:
    return os.path.exists(TMUX)


def run_on_terminal(argv: list[str], *, width: int, height: int = 50, timeout: float = 120,
                    env: dict[str, str] | None = None, tmpdir: str = "/tmp") -> tuple[list[str], int]:
    """Runs `argv` on a `width` x `height` terminal; returns (every line it showed,
    history included, trailing blank lines dropped; its exit code)."""
    sock = f"dcptool-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    conf = os.path.join(tmpdir, f"{sock}.conf")
    with open(conf, "w") as f:
        f.write("set -g history-limit 50000\nset -g remain-on-exit on\nset -g status off\n")
    # the command's environment: no COLUMNS/LINES (the terminal's own size must count)
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}
    base.update(env or {})
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in base.items() if k.isidentifier())
    chan = f"{sock}-done"
    tmux = [TMUX, "-L", sock, "-f", conf]
    # the pane tells the end on a tmux channel (kept until waited for): no polling
    script = f"env -i {exports} {shlex.join(argv)}; echo {END} $?; {shlex.join(tmux)} wait-for -S {chan}"
    try:
        subprocess.run([*tmux, "new-session", "-d", "-x", str(width), "-y", str(height), "sh", "-c", script],
                       check=True, timeout=30)
        try:
            subprocess.run([*tmux, "wait-for", chan], check=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{argv} did not end within {timeout}s on the terminal") from None
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-S", "-"], capture_output=True,
                                text=True, timeout=30).stdout
        ends = [ln for ln in screen.splitlines() if ln.startswith(END)]
        lines = screen.splitlines()
        lines = lines[:next(i for i, ln in enumerate(lines) if ln.startswith(END))]
        while lines and not lines[-1].strip():
            lines.pop()
        return lines, int(ends[0].split()[1])
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)
        os.unlink(conf)
