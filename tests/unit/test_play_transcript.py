"""What ``compactionrl play`` shows of an episode: each segment whole with
``--full`` or its end without, and the reward's parts (the end-to-end run is
tests/integration/test_bring_your_own.py's, through the command line)."""

from __future__ import annotations

from collections import Counter

from actors.episode import EpisodeResult
from deploy.play import TAIL_CHARS, reward_parts, segment_transcript
from protocol import RolloutStats

ENTRY = {"type": "summary", "tokens": 900, "trainable": 40, "step_rewards": 0.25,
         "text": "a" * TAIL_CHARS + "the tail"}


def test_full_shows_the_whole_segment_and_otherwise_its_end() -> None:
    whole = segment_transcript(3, ENTRY, full=True)
    assert whole == f"--- segment 3: summary, 900 tokens, 40 trainable:\n{ENTRY['text']}"
    end = segment_transcript(3, ENTRY, full=False)
    heading, text = end.split("\n", 1)
    assert heading == "--- segment 3: summary, 900 tokens, 40 trainable; ends with:"
    assert text == ENTRY["text"][-TAIL_CHARS:] and text.endswith("the tail")


def test_the_reward_s_parts_are_the_final_reward_the_step_rewards_and_the_info() -> None:
    stats = RolloutStats(outcome="done", success=False, steps=4, compactions=1,
                         generated_tokens=90, summary_tokens=20, duration_s=1.0)
    result = EpisodeResult("t", 0.5, stats, 0.0, 0, Counter(), info={"digits_right": 2})
    parts = reward_parts(result, [ENTRY, {**ENTRY, "step_rewards": -0.5}])
    assert parts == {"final": 0.5, "step_rewards": -0.25, "success": False,
                     "info": {"digits_right": 2}}
