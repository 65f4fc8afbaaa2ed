"""A real Prometheus server (Debian's `prometheus` package, installed by scripts/setup.sh
--test) for the --metrics tests: started on a free loopback port with a scrape config that
points at its targets (one or more) every second, its HTTP API read with urllib, stopped afterwards."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

from tests.support.ports import PortTaken, pick_port, start_with_retry
from tests.support.processes import stop_process

READY_WITHIN = 60.0   # seconds a start may take on a loaded machine


class Prometheus:
    def __init__(self, target: str | list[str], workdir):
        self.binary = shutil.which("prometheus")
        assert self.binary, "prometheus is not installed: scripts/setup.sh --test installs it"
        self.targets = [target] if isinstance(target, str) else list(target)
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> "Prometheus":
        return start_with_retry(self._start)

    def _start(self) -> "Prometheus":
        self.port = pick_port()
        config = self.workdir / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                          "scrape_configs:\n  - job_name: dcptool\n"
                          f"    static_configs:\n      - targets: {self.targets}\n")
        log = open(self.workdir / f"prometheus-{self.port}.log", "w+")
        self.proc = subprocess.Popen([self.binary, f"--config.file={config}",
                                      f"--storage.tsdb.path={self.workdir / f'data-{self.port}'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_WITHIN
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log.seek(0)
                text = log.read()
                if "address already in use" in text:
                    raise PortTaken(text)
                raise AssertionError(f"prometheus exited {self.proc.returncode}: {text[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError("prometheus was not ready in time")

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def wait_for(self, query: str, timeout: float = 60.0) -> list:
        """The result of an instant query once it has at least one series (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.api("query", query=query)["result"]
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
