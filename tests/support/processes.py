"""Ending the server processes tests start: terminate, then kill if it does not go, and
close its pipes."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def interrupt(proc: subprocess.Popen, timeout: float = 60) -> tuple:
    """SIGINT, as a user's Ctrl-C, then the process's (stdout, stderr) once it has ended."""
    import signal
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=timeout)


def kill_if_running(proc: subprocess.Popen) -> None:
    """For a `finally:`: a process a failed test left running is killed and reaped."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def interrupt_then_stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """For a `finally:`: SIGINT, as a user's Ctrl-C, a wait of up to `timeout` for the process
    to end by itself (its exit code stays for the test to check), then stop_process whatever
    happened, so nothing is left running."""
    import signal
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    finally:
        stop_process(proc)
