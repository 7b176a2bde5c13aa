"""learner/families.py: every listed family loads as a policy, a policy with
a value head and a critic, and its log-probabilities by the learner's own
paths (chunked, beside a value head) are the whole forward pass's; a model of
no listed family, or whose logits are more than the output layer's product,
is refused at load with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from learner.families import FAMILIES, UnsupportedModel, family_of
from learner.models import (
    load_critic,
    load_policy,
    pad,
    token_logprobs,
    token_logprobs_and_values,
)
from tests.tolerances import logprob_tolerance

#: A model of each family's shape at a few thousand parameters.
SIZES = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
         "max_position_embeddings": 64}


def _build(folder: Path, family: str, **settings: object) -> Path:
    """A random model of ``family``'s class, saved as an HF folder."""
    import transformers

    [name] = {f.name: f.classes for f in FAMILIES}[family][:1]
    config_class = getattr(transformers, name.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    getattr(transformers, name)(config_class(**SIZES, **settings)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", [family.name for family in FAMILIES])
def test_each_family_s_log_probabilities_by_every_path_are_the_whole_pass_s(
        family: str, tmp_path: Path) -> None:
    folder = str(_build(tmp_path / family, family))
    policy = load_policy(folder)
    assert family_of(policy).name == family
    ids = pad([torch.tensor([1, 5, 9, 2, 7, 7, 3]), torch.tensor([4, 8, 15, 16])])
    with torch.no_grad():
        whole = token_logprobs(policy, ids)
        chunked = token_logprobs(policy, ids, chunk_tokens=3)
        with_head, values = token_logprobs_and_values(load_policy(folder, value_head=True), ids,
                                                      chunk_tokens=3)
    tolerance = logprob_tolerance(policy, ids)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=tolerance)
    torch.testing.assert_close(with_head, whole, rtol=0, atol=tolerance)
    assert torch.equal(values, torch.zeros_like(values))  # a value head starts at zero
    # the critic's body is the policy's, read from the files under the family's name
    critic = load_critic(folder)
    body = dict(getattr(policy, family_of(policy).body).named_parameters())
    assert {name: torch.equal(p, body[name]) for name, p in critic.body.named_parameters()} == {
        name: True for name in body}


def test_a_model_of_no_listed_family_is_refused_with_where_to_add_one() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32))
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel.*learner/families.py"):
        family_of(model)


def test_a_subclass_of_a_family_s_class_is_that_family() -> None:
    """As a model with its own code that extends a known class is."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    class RemoteTinyForCausalLM(Qwen2ForCausalLM):
        pass

    assert family_of(RemoteTinyForCausalLM(Qwen2Config(**SIZES))).name == "qwen2"


@pytest.mark.parametrize("setting, value", [("final_logit_softcapping", 30.0),
                                            ("logit_scale", 0.0625)])
def test_logits_beyond_the_output_layer_s_product_are_refused(setting: str, value: float,
                                                              tmp_path: Path) -> None:
    """A soft cap or a scale the learner's log-probabilities would leave out."""
    folder = _build(tmp_path / "capped", "qwen2", **{setting: value})
    with pytest.raises(UnsupportedModel, match=setting):
        load_policy(str(folder))


def test_a_bias_on_the_output_layer_is_refused() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**SIZES))
    model.lm_head = nn.Linear(SIZES["hidden_size"], SIZES["vocab_size"], bias=True)
    with pytest.raises(UnsupportedModel, match="bias"):
        family_of(model)
