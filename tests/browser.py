"""Headless Chromium (Debian's, installed before the suite by `make test`:
deploy/install-chromium.sh) for the pages the project writes: the DOM once
their scripts ran, and a screenshot."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tests.processes import run_command

CHROMIUM = shutil.which("chromium")
#: As root, headless, nothing fetched from the network at start (this
#: machine's network is closed: without these, Chromium keeps trying).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium(*args: str) -> str:
    assert CHROMIUM is not None, "Chromium is not installed (deploy/install-chromium.sh)"
    with tempfile.TemporaryDirectory() as profile:
        result = run_command([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], 120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def rendered_dom(page: Path) -> str:
    """The page's DOM after its scripts ran (opened from disk)."""
    return _chromium("--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri())


def screenshot(page: Path, out: Path, width: int = 1500, height: int = 1700) -> Path:
    _chromium(f"--window-size={width},{height}", "--virtual-time-budget=5000",
              f"--screenshot={out}", page.resolve().as_uri())
    return out
