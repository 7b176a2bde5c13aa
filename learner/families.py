"""What the learner assumes of a model's architecture beyond its files: one
:class:`ModelFamily` per family, here and nowhere else, so that a user who
adds a family adds an entry to :data:`FAMILIES` (after checking the entry's
assumptions against the family's transformers code) and touches no other file.

Everything else a family brings is read, not assumed: parameter names and
shapes come from the safetensors files and transformers' model class; the
engines' loaders are vLLM's own; the chat framing is derived from the
model's template (actors/chat.py); the tool-call format belongs to the
fine-tune, not the architecture (``actors.environment.tool_parser``).

A model is matched by its class or any class it derives from, so a model
with its own code (``trust_remote_code``) that extends a known family's
class is that family. A model of no listed family is refused when the
learner loads it, with the reason, rather than trained on wrong assumptions.
So is one whose logits are more than the output layer's product with the
last hidden state: the learner computes that product itself (chunked, or
beside a value head), and a scale, cap or bias it left out would make every
importance ratio wrong without an error anywhere."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    """One family of decoder-only causal LMs as transformers builds them."""

    name: str
    #: transformers' causal-LM classes of the family (config.json's ``architectures``).
    classes: tuple[str, ...]
    #: The causal LM's attribute holding the body (embeddings, decoder layers,
    #: final norm), which returns ``last_hidden_state``; the same name
    #: prefixes the body's parameters in the files, which the critic's body is
    #: loaded from.
    body: str = "model"
    #: The body's attribute holding the decoder layers: each is an FSDP2 unit
    #: and, with activation checkpointing, recomputed in backward.
    layers: str = "layers"


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("qwen2", ("Qwen2ForCausalLM",)),
    ModelFamily("qwen3", ("Qwen3ForCausalLM",)),
    ModelFamily("llama", ("LlamaForCausalLM",)),
    ModelFamily("mistral", ("MistralForCausalLM",)),
)

#: Config settings with which a model's logits are more than the output
#: layer's product with the last hidden state (Gemma 2's soft cap, Cohere's
#: and Granite's scales).
LOGIT_SETTINGS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class UnsupportedModel(ValueError):
    """A model the learner would train on wrong assumptions."""


@functools.cache
def _listed(cls: type) -> ModelFamily | None:
    """The family listing ``cls`` or, first, one of its bases (a class is
    looked up once: :func:`body_of` runs at every forward pass)."""
    return next((family for base in cls.__mro__ for family in FAMILIES
                 if base.__name__ in family.classes), None)


def family_of(model: nn.Module) -> ModelFamily:
    """The family of ``model`` (a causal LM, on any device, meta included):
    the first of its classes, its own then its bases', that a family lists.
    Raises :class:`UnsupportedModel` where none does, or where its logits
    are not the output layer's plain product (:data:`LOGIT_SETTINGS`, a
    bias on the output layer). Called where a model is loaded."""
    name = type(model).__name__
    family = _listed(type(model))
    if family is None:
        known = ", ".join(listed for family in FAMILIES for listed in family.classes)
        raise UnsupportedModel(
            f"{name} is of no model family the learner knows ({known}); add one to "
            "learner/families.py once its body, decoder layers and logits are as an entry "
            "there says")
    config = getattr(model, "config", None)
    settings = [setting for setting in LOGIT_SETTINGS
                if getattr(config, setting, None) not in (None, 1.0)]
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        settings.append("a bias on the output layer")
    if settings:
        raise UnsupportedModel(
            f"{name}'s logits are more than the output layer's product with the last "
            f"hidden state ({', '.join(settings)}), which is all the learner's log-"
            "probabilities compute")
    return family


def _known(model: nn.Module) -> ModelFamily:
    """``model``'s family, checked by :func:`family_of` when it was loaded."""
    return _listed(type(model)) or family_of(model)


def body_of(model: nn.Module) -> nn.Module:
    """The body of causal LM ``model`` (see :attr:`ModelFamily.body`)."""
    return getattr(model, _known(model).body)


def layers_of(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of causal LM ``model`` (see :attr:`ModelFamily.layers`)."""
    return getattr(body_of(model), _known(model).layers)
