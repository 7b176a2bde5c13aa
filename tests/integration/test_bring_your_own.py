"""The bring-your-own guide of docs/environments.md, run as documented: the
tiny model with a Qwen3-style chat template plays a compacting episode on a
real vLLM engine, its framing derived and verified against the template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.processes import VENV_BIN, run_command

ROOT = Path(__file__).parents[2]
QWEN3_TEMPLATE = ROOT / "tests" / "unit" / "chat_templates" / "qwen3.jinja"


@pytest.mark.slow
def test_a_qwen3_style_template_plays_a_compacting_episode_end_to_end(tmp_path: Path) -> None:
    model = tmp_path / "qwen3-tiny"
    made = run_command([str(VENV_BIN / "compactionrl"), "model", "init", "--out", str(model)],
                       timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    shutil.copy(QWEN3_TEMPLATE, model / "chat_template.jinja")  # the guide's cp
    played = run_command([str(VENV_BIN / "compactionrl"), "play", "--model", str(model),
                          "--json", "--actors.compaction.context_tokens", "400",
                          "--actors.compaction.reserve_tokens", "120"], timeout=300)
    assert played.returncode == 0, played.stderr[-3000:]
    episode = json.loads(played.stdout.strip().splitlines()[-1])
    assert episode["compactions"] >= 1
    types = [segment["type"] for segment in episode["segments"]]
    assert types.count("summary") == episode["compactions"]
    assert all(segment["trainable"] > 0 for segment in episode["segments"])
    # each segment's whole text, framing included, and the reward's parts
    first = episode["segments"][0]["text"]
    assert first.startswith("<|im_start|>system") and "<|im_end|>" in first
    assert sum(len(segment["text"]) for segment in episode["segments"]) > 400
    parts = episode["reward_parts"]
    assert parts["final"] == episode["reward"] and parts["success"] == episode["success"]
    assert parts["step_rewards"] == 0.0  # KeyVault gives no shaping
    if episode["outcome"] == "done":  # KeyVault's part: the digits of the code it got right
        assert set(parts["info"]) == {"digits_right"}


def test_the_default_window_is_refused_with_the_room_this_template_needs(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Qwen3's framing costs more tokens per step than ChatML's: the actor
    says how much reserve the summary needs instead of overflowing."""
    from transformers import AutoTokenizer

    from actors.chat import ChatFormat
    from actors.context import CompactionContext
    from actors.envs.base import Task
    from deploy.config import load_config

    model = tmp_path / "qwen3-tiny"
    shutil.copytree(tiny_model_dir, model)
    shutil.copy(QWEN3_TEMPLATE, model / "chat_template.jinja")
    actors = load_config().actors
    chat = ChatFormat(AutoTokenizer.from_pretrained(model), actors.compaction,
                      actors.environment)
    with pytest.raises(ValueError, match="reserve_tokens = 80 cannot hold the summary request"):
        CompactionContext(chat.turns(Task("t", "s", "u")), actors.compaction)
