"""docs/report.png, made again: a real minute-long capture of the built-in producer (`serve dcp`
with 100,000 documents and 500 live updates a second, `capture --to forever --duration 1m`), its
`dcptool report`, drawn by headless Chromium and cut to the top of the page (the summary strip and
the first charts). Run from the repository: `.venv/bin/python scripts/report_png.py` (about 90 s;
needs chromium and Pillow, as the report tests do)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DCPTOOL = os.path.join(ROOT, ".venv", "bin", "dcptool")
OUT = os.path.join(ROOT, "docs", "report.png")


def main() -> int:
    from PIL import Image
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium is missing (scripts/setup.sh --test installs it)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as work:
        server = subprocess.Popen([DCPTOOL, "serve", "dcp", "--port", "0", "--items", "100000", "--rate", "500"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            address = json.loads(server.stdout.readline())["listening"]
            # relative paths: the page's title says "caps", not a temporary directory
            subprocess.run([DCPTOOL, "capture", f"couchbase://{address}/default", "-o", "caps", "--to", "forever",
                            "--duration", "1m", "--quiet"], cwd=work, check=True, timeout=180)
        finally:
            server.terminate()
            server.wait(30)
        subprocess.run([DCPTOOL, "report", "caps", "-o", "report.html"], cwd=work, check=True, timeout=600)
        png = os.path.join(work, "report.png")
        subprocess.run([chromium, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
                        "--virtual-time-budget=15000", f"--screenshot={png}", "--window-size=1280,2000",
                        "file://" + os.path.join(work, "report.html")], check=True, timeout=180,
                       capture_output=True)
        top = Image.open(png).convert("RGB").crop((0, 0, 1280, 1640)).resize((800, 1025))
        top.quantize(colors=64).save(OUT, optimize=True)
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
