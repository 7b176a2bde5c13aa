"""The rollout viewer's page opened in headless Chromium (Debian's,
installed by `make test`): what a reader sees once its script has run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from deploy.viewer import write_held_out, write_viewer
from ops.browser import CHROMIUM, rendered_dom, screenshot
from tests.viewer_runs import kept_run, played_held_out

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
    assert "the environment's info: digits_right 0 · attempts 1" in dom
    # the timeline: a lane per process and lane, a bar per span
    assert len(re.findall(r'<rect [^>]*class="span"', dom)) == 3
    assert "actor-a · slot 0" in dom and "learner · learner" in dom
    assert re.search(r'data-rendered-ms="\d+"', dom)  # drawn to the end (bench/samples.py times it)
    shot = screenshot(page, tmp_path / "viewer.png")
    assert shot.stat().st_size > 10_000


def test_an_evaluated_run_shows_one_held_out_task_before_and_after_training(
        tmp_path: Path, tokenizer: Any) -> None:
    run_dir = kept_run(tmp_path, tokenizer)
    write_held_out(run_dir, {"trained": ("export", played_held_out(tokenizer, "back")),
                             "baseline": ("base", played_held_out(tokenizer, "next"))})
    dom = rendered_dom(write_viewer(run_dir, tokenizer))
    assert re.search(r'class="rollout" data-id="baseline-0"', dom)
    assert re.search(r'class="rollout" data-id="trained-0"', dom)
    assert "held-out episode 0, before training (version 0)" in dom
    assert "sampled tokens (held out: not trained)" in dom
    # coloured by the advantage, which nothing trained them with: sampled
    # tokens without a colour, and the page drawn to its end all the same
    panes = dom[dom.index('id="panes"'):]
    assert 'class="trained"' in panes and 'class="trained" style=' not in panes
    assert re.search(r'data-rendered-ms="\d+"', dom)
