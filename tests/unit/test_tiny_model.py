"""The tiny model's tokenizer and weights (transformers side; vLLM is in integration)."""

from __future__ import annotations

import unicodedata
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.envs.vocabulary import WORDS
from starting_points.tiny_model import IM_END, IM_START


def test_every_vocabulary_word_is_one_token(tokenizer) -> None:
    split = [w for w in WORDS if len(tokenizer.encode(w)) != 1
             or len(tokenizer.encode(" " + w)) != 1]
    assert split == []


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_round_trips_through_byte_fallback(tokenizer, text: str) -> None:
    # transformers loads Qwen2-architecture tokenizers as Qwen2Tokenizer, which
    # normalises to NFC first, exactly as for real Qwen models.
    assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)


def test_chat_template_has_chatml_shape(tokenizer) -> None:
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "open the door"}],
        add_generation_prompt=True, tokenize=False)
    assert rendered == (f"{IM_START}system\ns{IM_END}\n{IM_START}user\nopen the door{IM_END}\n"
                        f"{IM_START}assistant\n")
    for special in (IM_START, IM_END):
        assert len(tokenizer.encode(special)) == 1
    assert tokenizer.eos_token == IM_END


def test_model_is_tiny_qwen2_with_tied_embeddings(tiny_model_dir: Path, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == len(tokenizer)
    parameters = sum(p.numel() for p in model.parameters())
    assert 100_000 <= parameters <= 1_000_000


def test_building_is_deterministic(tiny_model_dir: Path, tmp_path: Path) -> None:
    from starting_points.tiny_model import build_tiny_model

    again = build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
