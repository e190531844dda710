"""Open a report in headless Chromium (Debian's ``chromium``): the rendered DOM, a screenshot.

Used by the report's tests (the page as a browser draws it, plotly's script run) and to keep a
screenshot: ``python -m memfit.report._browser REPORT.html OUT.png``. Nothing is fetched: the
flags turn off every background request, and the report needs none.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

__all__ = ["chromium", "dump_dom", "screenshot"]

_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--hide-scrollbars")


def chromium() -> str | None:
    """The Chromium binary, or None where it is not installed (``apt-get install chromium``)."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


def _run(html_path: str, *extra: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("Chromium is not installed: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="memfit-chromium-") as profile:
        return subprocess.run(
            [exe, *_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000",
             *extra, "file://" + os.path.abspath(html_path)],
            capture_output=True, text=True, timeout=timeout_s, check=True)


def dump_dom(html_path: str) -> str:
    """The page's DOM after its scripts ran (the plot drawn)."""
    return _run(html_path, "--dump-dom").stdout


def screenshot(html_path: str, png_path: str, width: int = 1400, height: int = 1000) -> str:
    """A PNG of the page at ``width`` x ``height`` pixels."""
    _run(html_path, f"--screenshot={os.path.abspath(png_path)}",
         f"--window-size={width},{height}")
    return png_path


if __name__ == "__main__":
    if len(sys.argv) not in (3, 5):
        sys.exit("usage: python -m memfit.report._browser REPORT.html OUT.png [WIDTH HEIGHT]")
    size = [int(v) for v in sys.argv[3:5]] or [1400, 1000]
    print(screenshot(sys.argv[1], sys.argv[2], *size))
