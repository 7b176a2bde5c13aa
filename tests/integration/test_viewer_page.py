"""The rollout viewer's page opened in headless Chromium (Debian's,
installed by `make test`): what a reader sees once its script has run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from deploy.viewer import write_viewer
from ops.browser import CHROMIUM, rendered_dom, screenshot
from tests.viewer_runs import kept_run

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed: `make test` installs it as root "
                             "(deploy/install-chromium.sh)")


def test_the_page_draws_rollouts_token_colours_facts_and_the_timeline(
        tmp_path: Path, tokenizer: Any) -> None:
    page = write_viewer(kept_run(tmp_path, tokenizer), tokenizer)
    dom = rendered_dom(page)
    # the list: every kept rollout; the panes: the same task early and late
    assert len(re.findall(r'<div data-id="\d+-\d+"', dom)) == 3
    assert re.search(r'class="rollout" data-id="1-0"', dom)
    assert re.search(r'class="rollout" data-id="2-1"', dom)
    # each trained token coloured by its advantage (blue above 0, red below),
    # the context grey, the compaction point marked, the summary's facts
    trained = re.findall(
        r'<span class="trained"[^>]*style="background: rgb\((\d+), (\d+), (\d+)\);"', dom)
    assert len(trained) == 2 * 4  # the action and the summary's 3 tokens, in each pane
    # advantages +0.5 (the most of the rollout: full blue) and -0.25 (half red)
    assert set(trained) == {("0", "0", "255"), ("255", "128", "128")}
    assert 'class="context"' in dom and "compaction: the summary the policy wrote" in dom
    assert re.search(r'class="kept">alpha 7</span>.*class="dropped">alpha 2</span>', dom)
    assert "cross factor 0.500" in dom
    # the timeline: a lane per process and lane, a bar per span
    assert len(re.findall(r'<rect [^>]*class="span"', dom)) == 3
    assert "actor-a · slot 0" in dom and "learner · learner" in dom
    assert re.search(r'data-rendered-ms="\d+"', dom)  # drawn to the end (bench/samples.py times it)
    shot = screenshot(page, tmp_path / "viewer.png")
    assert shot.stat().st_size > 10_000
