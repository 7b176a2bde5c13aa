"""The rollout viewer's page opened in headless Chromium (Debian's,
installed by `make test`): what a reader sees once its script has run, its
colours as the browser computed them."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pytest

from deploy.cli import main
from deploy.viewer import write_held_out, write_viewer
from ops.browser import CHROMIUM, rendered_dom, screenshot
from tests.viewer_runs import kept_run, played_held_out

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed: `make test` installs it as root "
                             "(deploy/install-chromium.sh)")

#: WCAG 2's least contrast for body text (its AA level).
READABLE = 4.5
#: Appended to the page: once its script has drawn it, what the browser
#: computed of each element a reader has to read (its text colour, the first
#: background under it, its font size), written where the DOM dump shows it.
PROBE = """<script>
function under(element) {
  for (let e = element; e; e = e.parentElement) {
    const colour = getComputedStyle(e).backgroundColor;
    if (colour !== "rgba(0, 0, 0, 0)") return colour;
  }
  return "rgb(255, 255, 255)";
}
const seen = e => ({title: e.title || "", colour: getComputedStyle(e).color || "",
                    fill: getComputedStyle(e).fill, background: under(e),
                    size: parseFloat(getComputedStyle(e).fontSize)});
const all = selector => [...document.querySelectorAll(selector)];
const bar = document.querySelector("#legend .legend-bar");
const probe = document.createElement("pre");
probe.id = "probe";
probe.textContent = JSON.stringify({
  trained: all("#panes span.trained").map(seen), context: all("#panes span.context").map(seen),
  compaction: all("#panes .compaction").map(seen), kinds: all("#timeline text.kind").map(seen),
  legend: all("#legend .legend-ticks span").map(e => e.textContent),
  bar: bar ? getComputedStyle(bar).backgroundImage : "",
  ticks: all("#timeline text.tick").map(e => [e.textContent, Number(e.getAttribute("x"))]),
  rows: all("#list div").map(e => e.textContent)});
document.body.appendChild(probe);
</script>"""


def _rgb(colour: str) -> tuple[int, int, int]:
    """A computed colour, opaque: the browser writes them as rgb(r, g, b)."""
    match = re.fullmatch(r"rgb\((\d+), (\d+), (\d+)\)", colour)
    assert match, colour
    return int(match[1]), int(match[2]), int(match[3])


def _luminance(colour: str) -> float:
    """WCAG 2's relative luminance of an sRGB colour."""
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
              for c in (channel / 255 for channel in _rgb(colour))]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(text: str, background: str) -> float:
    """WCAG 2's contrast ratio of two colours, 1 to 21."""
    light, dark = sorted((_luminance(text), _luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def probed(page: Path) -> tuple[dict[str, Any], str]:
    """What the browser computed of the page (:data:`PROBE`), and its DOM."""
    probe = page.with_name("probed.html")
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = rendered_dom(probe)
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, "the page's script did not run to its end"
    return json.loads(html.unescape(found[1])), dom


@pytest.fixture(scope="module")
def kept_page(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """The page of a run with kept rollouts (tests/viewer_runs.py), not evaluated."""
    return write_viewer(kept_run(tmp_path_factory.mktemp("viewer"), tokenizer), tokenizer)


@pytest.fixture(scope="module")
def drawn(kept_page: Path) -> tuple[dict[str, Any], str]:
    """:func:`probed` of :func:`kept_page`: one browser for the tests that read it."""
    return probed(kept_page)


def test_the_contrast_ratio_is_wcag_s() -> None:
    assert contrast("rgb(0, 0, 0)", "rgb(255, 255, 255)") == pytest.approx(21)
    assert contrast("rgb(119, 119, 119)", "rgb(255, 255, 255)") == pytest.approx(4.48, abs=0.01)
    assert contrast("rgb(0, 0, 0)", "rgb(0, 0, 255)") == pytest.approx(2.44, abs=0.01)


def test_the_page_draws_rollouts_token_colours_facts_and_the_timeline(
        kept_page: Path, drawn: tuple[dict[str, Any], str], tmp_path: Path) -> None:
    seen, dom = drawn
    # the list: every kept rollout; the panes: the same task early and late
    assert len(re.findall(r'<div data-id="\d+-\d+"', dom)) == 3
    assert re.search(r'class="rollout" data-id="1-0"', dom)
    assert re.search(r'class="rollout" data-id="2-1"', dom)
    # each trained token tinted by its advantage, the context grey, the
    # compaction point marked, the summary's facts
    assert len(seen["trained"]) == 2 * 4  # the action and the summary's 3 tokens, in each pane
    assert 'class="context"' in dom and "compaction: the summary the policy wrote" in dom
    assert re.search(r'class="kept">alpha 7</span>.*class="dropped">alpha 2</span>', dom)
    assert "cross factor 0.500" in dom
    assert "the environment's info: digits_right 0 · attempts 1" in dom
    # the timeline: a lane per process and lane, a bar per span
    assert len(re.findall(r'<rect [^>]*class="span"', dom)) == 3
    assert "actor-a · slot 0" in dom and "learner · learner" in dom
    assert re.search(r'data-rendered-ms="\d+"', dom)  # drawn to the end (bench/samples.py times it)
    shot = screenshot(kept_page, tmp_path / "viewer.png")
    assert shot.stat().st_size > 10_000


def test_every_token_s_text_is_readable_on_its_tint_and_the_legend_gives_the_scale_s_values(
        drawn: tuple[dict[str, Any], str]) -> None:
    seen, _ = drawn
    by_advantage: dict[float, set[tuple[str, str]]] = {}
    for token in seen["trained"]:
        advantage = float(re.search(r"advantage: (\S+)", token["title"])[1])
        by_advantage.setdefault(advantage, set()).add((token["colour"], token["background"]))
    # both ends of the scale (the most |advantage| of the rollouts shown, 0.5)
    # and a point inside it, each one colour on both panes
    assert {a: len(c) for a, c in by_advantage.items()} == {0.5: 1, -0.5: 1, -0.25: 1}
    for advantage, ((text, background),) in by_advantage.items():
        assert contrast(text, background) >= READABLE, (advantage, text, background)
    (_, blue), (_, red) = by_advantage[0.5].pop(), by_advantage[-0.5].pop()
    assert _rgb(blue)[2] > _rgb(blue)[0] and _rgb(red)[0] > _rgb(red)[2]
    for context in seen["context"]:
        assert contrast(context["colour"], context["background"]) >= READABLE
    # the legend: the scale's ends and middle in advantage units, drawn in
    # the colours the tokens of those values have
    assert seen["legend"] == ["-0.5", "0", "0.5"]
    ends = re.findall(r"rgb\(\d+, \d+, \d+\)", seen["bar"])
    assert ends == [red, "rgb(255, 255, 255)", blue]
    # the compaction line's label: dark enough, and large enough, to read
    (label, *_) = seen["compaction"]
    assert contrast(label["colour"], label["background"]) >= READABLE and label["size"] >= 12


def test_the_list_names_each_rollout_s_actor_and_policy_versions_and_the_timeline_has_seconds(
        kept_page: Path, drawn: tuple[dict[str, Any], str]) -> None:
    seen, _ = drawn
    assert [row.split(" · ")[:3] for row in seen["rows"]] == [
        ["step 1", "actor a", "versions 3–4"], ["step 2", "actor b", "version 5"],
        ["step 2", "actor a", "versions 4–5"]]
    # an axis of seconds under the lanes, a tick each half second of the 4 s
    # the spans cover, each where its time is drawn (1,100 pixels from 260)
    spans = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>',
                                 kept_page.read_text(), re.S)[1])["timeline"]["spans"]
    end = max(start + length for _, _, start, length in spans)
    assert end == pytest.approx(4000, abs=1)
    labels = [label for label, _ in seen["ticks"]]
    assert labels == [f"{n / 2:g} s" for n in range(len(labels))]
    assert len(labels) in (8, 9)  # the 4 s one where the last span ends at 4 s or later
    for label, x in seen["ticks"]:
        assert x == pytest.approx(260 + 1100 * float(label[:-2]) * 1e3 / end, abs=0.01)
    # the key of span kinds: each name dark on the page, whatever its colour
    assert [kind["fill"] for kind in seen["kinds"]] and all(
        contrast(kind["fill"], kind["background"]) >= READABLE for kind in seen["kinds"])


def test_an_evaluated_run_shows_one_held_out_task_before_and_after_training(
        tmp_path: Path, tokenizer: Any) -> None:
    run_dir = kept_run(tmp_path, tokenizer)
    write_held_out(run_dir, {"trained": ("export", played_held_out(tokenizer, "back")),
                             "baseline": ("base", played_held_out(tokenizer, "next"))})
    dom = rendered_dom(write_viewer(run_dir, tokenizer))
    assert re.search(r'class="rollout" data-id="baseline-0"', dom)
    assert re.search(r'class="rollout" data-id="trained-0"', dom)
    assert ("held-out episode 0, before training · actor compactionrl eval · model base · "
            in dom)  # the list names who played it: the evaluation, with the model before training
    assert "held-out episode 0, before training (learner at version 0)" in dom
    assert "sampled tokens (held out: not trained)" in dom
    # coloured by the advantage, which nothing trained them with: sampled
    # tokens without a colour, and the page drawn to its end all the same
    panes = dom[dom.index('id="panes"'):]
    assert 'class="trained"' in panes and 'class="trained" style=' not in panes
    assert "the rollouts shown have no advantage" in dom  # the legend: no scale to give
    assert re.search(r'data-rendered-ms="\d+"', dom)


def test_the_view_command_draws_a_screenshot_of_the_page(
        tmp_path: Path, tokenizer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/running.md's command, ``compactionrl view --run RUN --screenshot
    PNG``: the page written again and drawn, with the run's own tokenizer."""
    run_dir = kept_run(tmp_path, tokenizer)
    tokenizer.save_pretrained(run_dir / "export")
    png = tmp_path / "viewer.png"
    assert main(["view", "--run", str(run_dir), "--screenshot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 10_000
    assert f"screenshot: {png}" in capsys.readouterr().out
