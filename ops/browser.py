"""Headless Chromium (Debian's: deploy/install-chromium.sh, which `make test`
runs) for the pages the project writes: the DOM once their scripts ran, and
a screenshot. The viewer's test and bench/samples.py open its page here."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

CHROMIUM = shutil.which("chromium")
#: A page of the project draws in seconds; this bounds a hung browser.
TIMEOUT_S = 120
#: As root, headless, nothing fetched from the network at start (this
#: machine's network is closed: without these, Chromium keeps trying).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium(*args: str) -> str:
    if CHROMIUM is None:
        raise RuntimeError("Chromium is not installed (deploy/install-chromium.sh)")
    with tempfile.TemporaryDirectory() as profile:
        # its own process group: Chromium's helpers go with it, whatever happens
        browser = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        try:
            out, err = browser.communicate(timeout=TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(browser.pid, signal.SIGKILL)
            browser.wait()
    if browser.returncode != 0:
        raise RuntimeError(f"chromium exited {browser.returncode}: {err[-3000:]}")
    return out


def rendered_dom(page: Path) -> str:
    """The page's DOM after its scripts ran (opened from disk)."""
    return _chromium("--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri())


def screenshot(page: Path, out: Path, width: int = 1500, height: int = 1700) -> Path:
    _chromium(f"--window-size={width},{height}", "--virtual-time-budget=5000",
              f"--screenshot={out}", page.resolve().as_uri())
    return out
