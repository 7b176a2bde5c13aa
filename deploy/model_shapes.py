"""A decoder-only model's shape, as the memory arithmetic of a GPU plan
(:mod:`deploy.memory_plan`) needs it, without the weights: read from a
``config.json`` (a path to one, or a folder holding one) or taken from a
small table of known families.

Usage::

    shape = shape_of("Qwen2.5-7B")                    # a known family
    shape = shape_of("/models/Qwen2.5-7B-Instruct")   # a folder with config.json
    shape.parameters, shape.kv_bytes_per_token
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a decoder-only model (Qwen2, Llama)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    source: str = ""
    """Where the shape came from: a config.json's path or a family's name."""

    @classmethod
    def of(cls, folder: str | Path) -> ModelShape | None:
        """The shape in ``folder/config.json``; None where there is none."""
        return _read_config(Path(folder) / "config.json")

    @property
    def kv_width(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def layer_parameters(self) -> int:
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_width
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        output = 0 if self.tied else self.embedding_parameters
        return (self.layers * self.layer_parameters + self.embedding_parameters + output
                + self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 keys and values of every layer, for one token."""
        return 2 * self.layers * self.kv_width * 2


#: Known families, copied from each model's config.json on the Hugging Face
#: Hub (huggingface.co/Qwen/<name>/blob/main/config.json and
#: huggingface.co/meta-llama/<name>/blob/main/config.json; the Instruct
#: variants have the same shapes). Fields: layers, hidden, intermediate,
#: attention heads, KV heads, vocabulary, tied embeddings.
FAMILIES: dict[str, ModelShape] = {
    "Qwen2.5-0.5B": ModelShape(24, 896, 4864, 14, 2, 151936, True),
    "Qwen2.5-1.5B": ModelShape(28, 1536, 8960, 12, 2, 151936, True),
    "Qwen2.5-3B": ModelShape(36, 2048, 11008, 16, 2, 151936, True),
    "Qwen2.5-7B": ModelShape(28, 3584, 18944, 28, 4, 152064, False),
    "Qwen2.5-14B": ModelShape(48, 5120, 13824, 40, 8, 152064, False),
    "Qwen2.5-32B": ModelShape(64, 5120, 27648, 40, 8, 152064, False),
    "Llama-3-8B": ModelShape(32, 4096, 14336, 32, 8, 128256, False),
    "Llama-3.2-1B": ModelShape(16, 2048, 8192, 32, 8, 128256, True),
    "Llama-3.2-3B": ModelShape(28, 3072, 8192, 24, 8, 128256, True),
}


def shape_of(source: str) -> ModelShape | None:
    """The shape ``source`` names: an existing ``config.json`` (or a folder
    holding one), else a known family (case aside, an ``org/`` prefix and an
    ``-Instruct`` suffix ignored, as in Hub ids); None where it is neither."""
    path = Path(source)
    if path.exists():
        return _read_config(path / "config.json" if path.is_dir() else path)
    name = source.rsplit("/", 1)[-1].lower().removesuffix("-instruct")
    known = {family.lower(): family for family in FAMILIES}
    return replace(FAMILIES[known[name]], source=known[name]) if name in known else None


def _read_config(path: Path) -> ModelShape | None:
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    return ModelShape(config["num_hidden_layers"], config["hidden_size"],
                      config["intermediate_size"], config["num_attention_heads"],
                      config.get("num_key_value_heads", config["num_attention_heads"]),
                      config["vocab_size"], bool(config.get("tie_word_embeddings", False)),
                      str(path))
