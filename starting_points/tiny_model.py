"""The tiny model of the embedded default, built locally in seconds.

An HF-format Qwen2 causal LM with a few hundred thousand parameters and tied
embeddings, and a byte-level BPE tokenizer in which every word of
:data:`actors.envs.vocabulary.WORDS` is one token (with and without a leading
space). Byte-level means any other text still tokenizes and decodes without
loss (after NFC normalisation: transformers and vLLM load any Qwen2-architecture
tokenizer as ``Qwen2Tokenizer``, which normalises to NFC, as for real Qwen).
The chat template has the shape of Qwen's (ChatML), so the agent code treats
the tiny model and real Qwen models the same way.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from actors.envs.vocabulary import WORDS

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)

#: ChatML, as Qwen2 uses it: <|im_start|>role\ncontent<|im_end|>\n per turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class TinyModelConfig:
    """Shape of the tiny Qwen2 model."""

    hidden_size: int = 128
    """Width; with 4 heads the head size is 32, the smallest vLLM's CPU attention supports."""
    intermediate_size: int = 384
    num_layers: int = 2
    """Two layers: learning speed on CPU decides what RL fits in minutes, and
    a 2-layer model already copies facts from its context reliably."""
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 4096
    """Must be >= the engines' max_model_len."""
    init_std: float = 0.05
    """Normal init std of all weights; larger than the usual 0.02 so that a
    random model's next-token distribution is not flat."""
    seed: int = 0


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE whose merges make each vocabulary word a single token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=100_000,  # never the limit: training stops when every word is whole
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Each word (and punctuation mark and digit, which the environments'
    # texts put between spaces) at the start of a line and after a space,
    # twice (min_frequency).
    pieces = WORDS + tuple(".,:") + tuple("0123456789")
    corpus = [f"{piece}\n {piece}" for piece in pieces for _ in range(2)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


@contextlib.contextmanager
def temporary_tiny_model() -> Iterator[str]:
    """A fresh tiny model in a temporary folder, removed afterwards: what a
    benchmark's quick run plays or trains."""
    with tempfile.TemporaryDirectory() as folder:
        yield str(build_tiny_model(Path(folder) / "tiny"))


def build_tiny_model(out: Path, config: TinyModelConfig | None = None) -> Path:
    """Write model (safetensors), config, tokenizer and chat template to ``out``."""
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    config = config or TinyModelConfig()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        bos_token=None,
        additional_special_tokens=[IM_START],
        model_max_length=config.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        initializer_range=config.init_std,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(model_config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _write_generation_config(out, model_config)
    return out


def _write_generation_config(out: Path, model_config: object) -> None:
    # Plain sampling defaults; the actors set their own sampling parameters.
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": model_config.eos_token_id,
        "pad_token_id": model_config.pad_token_id,
        "do_sample": True,
    }, indent=2))
