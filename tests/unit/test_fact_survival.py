"""Where a KeyVault episode loses its facts (deploy/fact_survival.py), on
episodes written word by word: a token is a word, so a segment's text is
exactly what the test wrote."""

from __future__ import annotations

from pathlib import Path

from actors.context import ClosedSegment
from actors.episode import EpisodeResult
from deploy.fact_survival import (
    Fact,
    Layout,
    account,
    layout_of,
    mentions_in,
    notes_in,
    summarise_facts,
)
from protocol import RolloutStats
from tests.scripts import import_script

ROOT = Path(__file__).parents[2]

TASK = "you are an agent . each reply is one action . codes : alpha , 3 digits each ."
WORDS: list[str] = []


def ids(text: str) -> list[int]:
    for word in text.split():
        if word not in WORDS:
            WORDS.append(word)
    return [WORDS.index(word) for word in text.split()]


def decode(tokens: list[int]) -> str:
    return " ".join(WORDS[t] for t in tokens)


def segment(kind: str, *parts: tuple[str, bool]) -> ClosedSegment:
    """A segment of ``(text, sampled)`` parts."""
    data = ClosedSegment(kind)  # type: ignore[arg-type]
    for text, sampled in parts:
        data.tokens += ids(text)
        data.loss_mask += [int(sampled)] * len(text.split())
    return data


def context(text: str) -> tuple[str, bool]:
    return text, False


def sampled(text: str) -> tuple[str, bool]:
    return text, True


def result(outcome: str = "done", success: bool = False) -> EpisodeResult:
    stats = RolloutStats(outcome=outcome, success=success, steps=4, compactions=1,  # type: ignore[arg-type]
                         generated_tokens=10, summary_tokens=2, duration_s=1.0)
    return EpisodeResult("keyvault-1", float(success), stats, 0.0, 0)


ALPHA = Layout(3, ("alpha",), False)
FIRST_WINDOW = [context(TASK), sampled("next"), context("room 1 : red . note : alpha seven ."),
                sampled("next"), context("room 2 : cat . note : alpha two .")]


def compacted_episode(summary: str, kept_step: str, after: list[tuple[str, bool]]
                      ) -> list[ClosedSegment]:
    """Two notes read, one compaction with ``summary`` (the rebuilt window
    keeps ``kept_step``), then ``after``."""
    return [segment("execution", *FIRST_WINDOW),
            segment("summary", *FIRST_WINDOW, context("stop . write a summary ."),
                    sampled(summary)),
            segment("execution", context(f"{TASK} summary : {summary} continue . {kept_step}"),
                    *after)]


LAST_ROOM = [sampled("next"), context("room 3 : sun . note : alpha five .")]


def test_a_fact_the_summary_dropped_is_lost_in_compaction() -> None:
    episode = compacted_episode("alpha seven", "", [*LAST_ROOM, sampled("answer alpha 7 5"),
                                                    context("answer wrong .")])
    facts = account(episode, result(), ALPHA, decode)
    assert facts.read == {Fact("alpha", None, d) for d in (7, 2, 5)}
    assert facts.compactions == ((2, 1),)
    assert facts.at_answer == 2
    assert facts.cause == "lost in compaction"


def test_a_kept_step_keeps_its_note_through_a_compaction() -> None:
    episode = compacted_episode("alpha seven", "next room 2 : cat . note : alpha two .",
                                [*LAST_ROOM, sampled("answer alpha 7 2 9")])
    facts = account(episode, result(), ALPHA, decode)
    assert facts.compactions == ((2, 2),)
    assert facts.at_answer == 3 and facts.steps_since_compaction == 1
    assert facts.cause == "wrong answer"


def test_an_answer_before_the_last_note_is_never_read() -> None:
    episode = compacted_episode("alpha seven two", "", [sampled("answer alpha 7 2")])
    facts = account(episode, result(), ALPHA, decode)
    assert len(facts.read) == 2 and facts.at_answer == 2
    assert facts.cause == "never read"


def test_an_episode_that_ends_without_an_answer_is_counted_as_such() -> None:
    episode = compacted_episode("alpha seven two", "", LAST_ROOM)
    facts = account(episode, result("compaction_limit"), ALPHA, decode)
    assert facts.at_answer is None and facts.cause == "no answer"
    assert account(episode, result(success=True), ALPHA, decode).cause == "success"


def test_a_digit_is_a_fact_only_after_its_code_s_name() -> None:
    assert mentions_in("each reply is one action . codes : alpha", ["alpha"], False) == set()
    assert mentions_in("alpha seven bravo two", ["alpha", "bravo"], False) == {
        Fact("alpha", None, 7), Fact("bravo", None, 2)}


def test_an_ordered_fact_needs_its_position() -> None:
    assert mentions_in("alpha second seven three", ["alpha"], True) == {Fact("alpha", 1, 7)}
    assert notes_in("room 4 : note : alpha second seven .") == {Fact("alpha", 1, 7)}
    assert notes_in("room 4 : note : alpha seven .") == {Fact("alpha", None, 7)}


def test_the_summary_of_episodes_gives_causes_and_survival_per_compaction() -> None:
    lost = account(compacted_episode("alpha seven", "", [*LAST_ROOM, sampled("answer 7 5")]),
                   result(), ALPHA, decode)
    kept = account(compacted_episode("alpha seven two", "", [*LAST_ROOM, sampled("answer")]),
                   result(success=True), ALPHA, decode)
    summary = summarise_facts([lost, kept])
    assert summary["causes"]["success"] == 0.5 and summary["causes"]["lost in compaction"] == 0.5
    assert summary["kept_by_compaction"] == {1: 3 / 4}
    assert summary["facts_by_compaction"] == {1: 4}
    assert summary["read"] == 1.0 and summary["in_answer_window"] == 5 / 6
    assert summary["answers_with_every_fact"] == 1 and summary["wrong_with_every_fact"] == 0.0
    assert summary["wrong_with_every_fact_by_steps_since_compaction"] == {
        1: {"answers": 1, "wrong": 0.0}}


def test_a_task_s_layout_is_read_from_the_environment_at_its_seed() -> None:
    import asyncio

    layout = asyncio.run(layout_of({"codes": [1, 3], "digits": 2, "rooms": 10}, 5))
    assert layout.facts == 2 * len(layout.codes) and layout.ordered
    assert layout.codes == ("alpha", "bravo", "charlie")[:len(layout.codes)]


def test_the_horizons_docs_give_the_fact_table_and_its_chart(tmp_path: Path) -> None:
    horizons = import_script(ROOT / "bench" / "horizons.py", "horizons_under_test")
    sizes = {"rooms 6": {"rooms": 6}, "rooms 10 (the local default)": {},
             "distractor words 8": {"distractor_words": 8}}
    lost = account(compacted_episode("alpha seven", "", [*LAST_ROOM, sampled("answer 7 5")]),
                   result(), ALPHA, decode)
    kept = account(compacted_episode("alpha seven two", "", [*LAST_ROOM, sampled("answer")]),
                   result(), ALPHA, decode)
    survival = summarise_facts([lost])
    success = {"success": 0.0, "success_ci95": (0.0, 0.5), "compactions_per_episode": 1.0}
    report = {"episodes": 1, "max_compactions": 8, "policies": {"base": "runs/base-model"},
              "sizes": sizes, "success": {"base": dict.fromkeys(sizes, success)},
              "facts": {"base": {**dict.fromkeys(sizes, summarise_facts([lost, kept])),
                                 "rooms 6": survival}}}
    (tmp_path / "results.md").write_text("<!-- begin horizons -->\n<!-- end horizons -->\n")
    horizons.write_docs(report, tmp_path, "python bench/horizons.py")
    text = (tmp_path / "results.md").read_text()
    assert "| rooms 6 | base | 0 | 0 | 0 | 100 | 0 | 100 | 50 | 67 | - |" in text, text
    assert "| rooms 6 | base | - | - | - | - |" in text, text
    assert "| rooms 10 (the local default) | base | - | 100 (1) | - | - |" in text, text
    for stem in ("fact_survival", "answers_with_every_fact"):
        chart = (tmp_path / "images" / f"{stem}.svg").read_text()
        assert chart.startswith("<svg") and ">base</text>" in chart, chart
        assert f"(images/{stem}.svg)" in text
