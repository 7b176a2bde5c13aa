"""``compactionrl bootstrap``: a supervised base policy for ``keyvault``.

RL needs a starting policy that already plays the game and already compacts,
but compacts badly — as a real base model does. This module makes one from
the tiny model in a few minutes on CPU:

1. **Demonstrations.** A scripted player (:class:`Demonstrator`) plays
   keyvault through the real agent loop (:func:`actors.episode.run_episode`,
   the same chat format, windows and compactions as the actors), so every
   demonstration token is exactly what the policy will see and produce. It
   reads only its own context: it says ``next`` until the rooms run out, then
   answers with the digits it can see (a digit it cannot see is guessed).
2. **The imperfection recipe** (:class:`starting_points.config.BootstrapConfig`, reported with
   every result): each summary keeps every fact visible in the window *with
   probability* ``1 - drop_fact_probability``, independently. A fine-tuned
   model copies that habit, so facts that pass through more compactions are
   more likely lost; RL must learn to keep them all. Actions are always right.
3. **Fine-tuning**: cross-entropy on the sampled tokens (the loss mask of the
   segments: actions, answers and summaries), AdamW with linear decay.

The out folder is an HF model like any other, plus ``bootstrap.json`` with
the recipe, the demonstrations' success rate and the loss curve.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import ClosedSegment, Generation
from actors.envs.base import load_environment
from actors.envs.keyvault import CODE_NAMES, NUMBER_WORDS, ORDINALS, KeyVault
from actors.episode import EpisodeResult, run_episode
from starting_points.config import BootstrapConfig

#: A fact as keyvault's notes state it: "alpha second seven", or "alpha seven"
#: when the code's digits are unordered; summaries state kept facts the same way.
ORDERED_FACT = re.compile(rf"\b({'|'.join(CODE_NAMES)}) ({'|'.join(ORDINALS)}) "
                          rf"({'|'.join(NUMBER_WORDS[:10])})\b")
UNORDERED_FACT = re.compile(rf"\b({'|'.join(CODE_NAMES)}) ({'|'.join(NUMBER_WORDS[:10])})\b")
#: The agent's own answer ("answer alpha seven two five"): with ``retries`` a
#: wrong one stays in view, and its guesses are not facts.
OWN_ANSWER = re.compile(
    rf"\banswer(?: (?:{'|'.join(CODE_NAMES)}|{'|'.join(NUMBER_WORDS[:10])}|\d))+")
#: Seeds of demonstrations: a range of their own, below evaluation's 2^31.
DEMONSTRATION_SEED_SALT = "bootstrap"
#: Demonstrations played after fine-tuning to measure copying (~5 s on CPU).
HELD_OUT_DEMONSTRATIONS = 100


@dataclass(frozen=True)
class KeptBase:
    """A base policy kept in the checkout: its folder and its :func:`base_digest`
    (a kept base with other weights or another recipe is not the one its
    figures describe)."""

    folder: Path
    digest: str


#: The kept base policies of a checkout, by the model folder a configuration
#: names (``run.model``). A fresh bootstrap is not bit-reproducible across
#: machines, so ``up`` restores the kept one where that folder is missing
#: (``compactionrl bootstrap`` makes a new one). ``runs/base-model``: the
#: embedded default's, the base the README's demo figure and docs/results.md's
#: paper-recipe table start from (its digest as docs/results-paper-runs.json
#: records it). ``runs/base-size-range``: deploy/configs/size-range.toml's,
#: bootstrapped on that file's range of sizes (docs/results.md, "Outside the
#: training range"). ``runs/base-retries``: deploy/configs/retries.toml's,
#: bootstrapped on keyvault with retries (docs/results.md, "unequal compaction").
KEPT_BASES = {
    "runs/base-model": KeptBase(
        Path(__file__).parents[1] / "docs" / "results-paper-base",
        "987b1ac67e676e9f9dda019ea958ed35ba1e4f2febe1d30e6308ec60321c1f6d"),
    "runs/base-size-range": KeptBase(
        Path(__file__).parents[1] / "docs" / "results-size-range-base",
        "231afb61597fc39d4fe1edb8ac345b398ea683fa0c4d7416836721b8b6d02668"),
    "runs/base-retries": KeptBase(
        Path(__file__).parents[1] / "docs" / "results-retries-base",
        "be1ccf1a60407662b67b2ad85dc08f141856f000f4895607c5fc40c498ca753a"),
}


def facts_in(text: str, ordered: bool) -> dict[tuple[str, str], str]:
    """Facts stated in ``text`` (the agent's own answers left out), in order of
    first statement: value by (code, ordinal), later statements winning;
    unordered, value by (code, value)."""
    text = OWN_ANSWER.sub("", text)
    if ordered:
        return {(code, position): digit for code, position, digit in ORDERED_FACT.findall(text)}
    return {(code, digit): digit for code, digit in UNORDERED_FACT.findall(text)}


def values_by_code(facts: dict[tuple[str, str], str]) -> dict[str, list[str]]:
    """The values of ``facts`` of each code, in order."""
    values: dict[str, list[str]] = {}
    for (code, _), digit in facts.items():
        values.setdefault(code, []).append(digit)
    return values


class Demonstrator:
    """The scripted keyvault player; a :class:`actors.episode.Policy`.

    It sees what the policy would see — the prompt tokens — and nothing of
    the environment's state. Its generations carry log-probability 0 and
    version 0 (they are demonstrations, not samples).
    """

    def __init__(self, chat: ChatFormat, codes: tuple[str, ...], digits: int,
                 drop_fact_probability: float, rng: random.Random, ordered: bool) -> None:
        self.chat = chat
        self.codes, self.digits, self.ordered = codes, digits, ordered
        self.drop_fact_probability = drop_fact_probability
        self.rng = rng
        self._summary_suffix = chat.summary_request + chat.assistant_header

    async def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                       temperature: float | None = None) -> Generation:
        text = self.chat.decode(prompt)
        if prompt[-len(self._summary_suffix):] == self._summary_suffix:
            reply = self.summary(text)
        elif "no more rooms" in text.rsplit("assistant", 2)[-2]:  # the last observation
            reply = self.answer(text)
        else:
            reply = "next"
        ids = self.chat.tokenizer.encode(reply, add_special_tokens=False)
        ids = ids[: max(0, max_tokens - len(self.chat.assistant_end))] + self.chat.assistant_end
        return Generation(ids, [0.0] * len(ids), [0] * len(ids))

    def summary(self, text: str) -> str:
        """Kept facts by code, then by position (ordered) or by value
        (unordered: the next value to write is then the smallest one in view
        above the last written, which one attention head can find; in order
        of appearance it would take an induction head, and in any order the
        tiny model repeats values)."""
        facts = facts_in(text, self.ordered)
        in_order = sorted(facts, key=lambda key: (
            CODE_NAMES.index(key[0]),
            ORDINALS.index(key[1]) if self.ordered else NUMBER_WORDS.index(key[1])))
        kept = [key for key in in_order if self.rng.random() >= self.drop_fact_probability]
        if not kept:
            return "no facts kept ."
        if self.ordered:
            return " ".join(f"{code} {position} {facts[code, position]} ."
                            for code, position in kept)
        return " ".join(f"{code} {digit} ." for code, digit in kept)

    def answer(self, text: str) -> str:
        """Every code's digits in view (unordered: by value, as summaries
        list them); a digit not in view is guessed."""
        known = facts_in(text, self.ordered)
        words = ["answer"]
        for code in self.codes:
            words.append(code)
            if self.ordered:
                for position in ORDINALS[:self.digits]:
                    digit = known.get((code, position))
                    words.append(digit if digit is not None
                                 else NUMBER_WORDS[self.rng.randrange(10)])
                continue
            seen = sorted(values_by_code(known).get(code, []), key=NUMBER_WORDS.index)
            seen = seen[:self.digits]
            unseen = [digit for digit in NUMBER_WORDS[:10] if digit not in seen]
            words += seen + self.rng.sample(unseen, self.digits - len(seen))
        return " ".join(words)


def demonstration_seed(run_seed: int, n: int) -> int:
    """The n-th demonstration's episode seed, in [0, 2^31) like training's."""
    digest = hashlib.blake2b(f"{DEMONSTRATION_SEED_SALT}/{run_seed}/{n}".encode(),
                             digest_size=4).digest()
    return int.from_bytes(digest, "big") >> 1


def _keyvault(actors: ActorConfig) -> KeyVault:
    """The configured environment, which bootstrap can demonstrate only if it is keyvault."""
    environment = load_environment(actors.environment.factory, actors.environment.options)
    if not isinstance(environment, KeyVault):
        raise ValueError(f"bootstrap demonstrates keyvault only, not {actors.environment.factory}")
    return environment


async def demonstrate(chat: ChatFormat, actors: ActorConfig, recipe: BootstrapConfig,
                      held_out: int = 0) -> tuple[list[ClosedSegment], list[EpisodeResult]]:
    """Play ``recipe.demonstrations`` episodes; their segments and results.
    With ``held_out``, that many further episodes instead (never trained on)."""
    options = actors.environment.options
    probe = _keyvault(actors)
    if any(low != high for low, high in (probe.sizes["codes"], probe.sizes["digits"])):
        raise ValueError("bootstrap demonstrates a fixed number of codes and digits (ranges "
                         "of rooms and distractor words are fine)")
    codes, digits = CODE_NAMES[: probe.sizes["codes"][0]], probe.sizes["digits"][0]
    rng = random.Random(recipe.seed)
    segments: list[ClosedSegment] = []
    results: list[EpisodeResult] = []

    async def keep(task_id: str, segment: ClosedSegment, result: EpisodeResult | None) -> None:
        segments.append(segment)
        if result is not None:
            results.append(result)

    player = Demonstrator(chat, codes, digits, recipe.drop_fact_probability, rng,
                          ordered=probe.ordered)
    numbers = (range(recipe.demonstrations, recipe.demonstrations + held_out) if held_out
               else range(recipe.demonstrations))
    for n in numbers:
        environment = load_environment(actors.environment.factory, options)
        await run_episode(player, environment, chat, actors,
                          demonstration_seed(recipe.seed, n), keep)
    return segments, results


def training_sequences(segments: list[ClosedSegment]) -> list[tuple[list[int], list[int]]]:
    """(tokens, loss mask) to fine-tune on. A summary segment's prompt is the
    execution segment before it, so the pair is one sequence with both
    segments' trained tokens: the same loss at ~60 % of the tokens."""
    sequences: list[tuple[list[int], list[int]]] = []
    for n, segment in enumerate(segments):
        after = segments[n + 1] if n + 1 < len(segments) else None
        if (after is not None and segment.segment_type == "execution"
                and after.segment_type == "summary"
                and after.tokens[:len(segment.tokens)] == segment.tokens):
            continue  # trained as the prefix of the summary segment
        before = segments[n - 1] if n else None
        if (segment.segment_type == "summary" and before is not None
                and segment.tokens[:len(before.tokens)] == before.tokens):
            mask = before.loss_mask + segment.loss_mask[len(before.tokens):]
            sequences.append((segment.tokens, mask))
        else:
            sequences.append((segment.tokens, segment.loss_mask))
    return sequences


def fine_tune(model_dir: Path, segments: list[ClosedSegment], recipe: BootstrapConfig,
              log: Any = print) -> list[float]:
    """Supervised fine-tuning on the loss-masked tokens; returns the mean
    loss of each logged interval. The model in ``model_dir`` is rewritten."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimiser = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    sequences = training_sequences(segments)
    total = recipe.epochs * -(-len(sequences) // recipe.batch_sequences)
    # Linear decay to 0: the last steps settle the copying the summaries need.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda step: 1 - step / total)
    order = random.Random(recipe.seed)
    pad = model.config.pad_token_id or 0
    curve: list[float] = []
    window: list[float] = []
    steps = 0
    for _ in range(recipe.epochs):
        indices = list(range(len(sequences)))
        order.shuffle(indices)
        for start in range(0, len(indices), recipe.batch_sequences):
            batch = [sequences[i] for i in indices[start:start + recipe.batch_sequences]]
            width = max(len(ids) for ids, _ in batch)
            tokens = torch.full((len(batch), width), pad, dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            for row, (ids, loss_mask) in enumerate(batch):
                n = len(ids)
                tokens[row, :n] = torch.tensor(ids)
                mask = torch.tensor(loss_mask, dtype=torch.bool)
                labels[row, :n] = torch.where(mask, tokens[row, :n], -100)
            # Right padding under a causal mask: no real token sees a pad, so
            # no attention mask is needed (and SDPA keeps its fast causal path).
            loss = model(input_ids=tokens, labels=labels).loss
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            schedule.step()
            steps += 1
            window.append(loss.item())
            if steps % 20 == 0 or steps == total:
                curve.append(sum(window) / len(window))
                log(f"  step {steps}/{total}: loss {curve[-1]:.4f}")
                window = []
    model.save_pretrained(model_dir, safe_serialization=True)
    return curve


def copy_accuracy(model_dir: Path, chat: ChatFormat, segments: list[ClosedSegment],
                  ordered: bool) -> dict[str, float]:
    """How often the model, teacher-forced on demonstrations, puts its most
    likely token on a right copy where the player copied a fact's value: in
    summaries (every value there is a copy) and in answers (values in view;
    the player's guesses are left out). A right copy is the value of the
    position just named (ordered), or any value of the code in view not yet
    written in this reply (unordered: the player's order is its own choice).
    Copying decides success: an exact answer needs every copy right through
    every compaction. Also the number of values of each kind
    (``summary_values``, ``answer_values``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = chat.tokenizer
    value_ids = {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(f" {word}"))[0]: word
                 for word in NUMBER_WORDS[:10]}
    right = {"summary": 0, "answer": 0}
    total = {"summary": 0, "answer": 0}
    for segment in segments:
        with torch.no_grad():
            predicted = model(input_ids=torch.tensor([segment.tokens])).logits[0].argmax(-1)
        kind = "summary" if segment.segment_type == "summary" else None
        visible: dict[tuple[str, str], str] | None = None
        reply_start = 0
        written: list[str] = []  # words of the reply being checked
        for i, token in enumerate(segment.tokens):
            if not segment.loss_mask[i]:
                written = []
                continue
            word = chat.decode([token]).strip()
            if not written:  # a reply begins: it may copy what precedes it
                reply_start, visible = i, None
            written.append(word)
            if word == "answer":
                kind = "answer"
                written = [word]
            if token not in value_ids or kind is None:
                continue
            codes_named = [n for n, w in enumerate(written) if w in CODE_NAMES]
            if not codes_named:
                continue
            if visible is None:  # decoded once per reply that states a value
                visible = facts_in(chat.decode(segment.tokens[:reply_start]), ordered)
            acceptable = _right_copies(written, codes_named, kind, visible, ordered)
            if word not in acceptable:
                continue  # a guess, not a copy
            total[kind] += 1
            right[kind] += int(value_ids.get(int(predicted[i - 1])) in acceptable)
    report: dict[str, float] = {}
    for kind in total:
        report[kind] = right[kind] / total[kind] if total[kind] else float("nan")
        report[f"{kind}_values"] = total[kind]
    return report


def _right_copies(written: list[str], codes_named: list[int], kind: str,
                  visible: dict[tuple[str, str], str], ordered: bool) -> set[str | None]:
    """The values the last word of ``written`` (a reply so far, whose words
    at ``codes_named`` are code names) may rightly be, given the facts
    ``visible`` before the reply."""
    named_at = codes_named[-1]
    code = written[named_at]
    if ordered:
        # a summary names the position before the value; an answer by place
        place = len(written) - named_at - 2
        position = (written[-2] if kind == "summary"
                    else ORDINALS[place] if place < len(ORDINALS) else None)
        return {visible.get((code, position))}
    done = {w for w in written[named_at + 1:-1] if w in NUMBER_WORDS[:10]}
    done |= {w for n in codes_named[:-1] if written[n] == code for w in written[n + 1:n + 2]}
    return set(values_by_code(visible).get(code, [])) - done


def made_for(actors: ActorConfig, recipe: BootstrapConfig) -> dict[str, Any]:
    """The settings a base policy is made with, as ``bootstrap.json`` records them."""
    return json.loads(json.dumps({
        "recipe": asdict(recipe),
        "environment": {"factory": actors.environment.factory,
                        "options": actors.environment.options},
        "compaction": asdict(actors.compaction)}))


def differences(model: Path, actors: ActorConfig, recipe: BootstrapConfig) -> list[str]:
    """Where the settings ``model`` was bootstrapped with differ from these
    ("name: then -> now"); none for a model without ``bootstrap.json``."""
    record = model / "bootstrap.json"
    if not record.is_file():
        return []
    then, now = json.loads(record.read_text()), made_for(actors, recipe)

    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(tree, dict):
            return {prefix: tree}
        return {k: v for key, value in tree.items()
                for k, v in flat(value, f"{prefix}.{key}" if prefix else key).items()}

    old, new = flat({k: then.get(k) for k in now}), flat(now)
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
            for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]


def base_digest(base: Path) -> str:
    """A base policy's identity: its weights and what it was bootstrapped
    with (not how long that took)."""
    digest = hashlib.sha256()
    for weights in sorted(base.glob("*.safetensors")):
        digest.update(weights.name.encode())
        digest.update(weights.read_bytes())
    made = json.loads((base / "bootstrap.json").read_text())
    made.pop("seconds", None)
    digest.update(json.dumps(made, sort_keys=True).encode())
    return digest.hexdigest()


def restore_kept_base(out: Path, actors: ActorConfig, recipe: BootstrapConfig,
                      kept: KeptBase) -> str | None:
    """Copy the kept base policy to ``out`` if it is there, intact (its
    digest) and made with these settings; else None and why not, for the
    caller to say before it bootstraps."""
    if not (kept.folder / "bootstrap.json").is_file():
        return f"no kept base at {kept.folder}"
    if (found := base_digest(kept.folder)) != kept.digest:
        return f"the kept base at {kept.folder} is not the recorded one (digest {found[:12]})"
    if changed := differences(kept.folder, actors, recipe):
        return f"the kept base was made with other settings ({'; '.join(changed)})"
    shutil.copytree(kept.folder, out, dirs_exist_ok=True)
    return None


def bootstrap(out: Path, actors: ActorConfig, recipe: BootstrapConfig,
              log: Any = print) -> dict[str, Any]:
    """Make the base policy in ``out`` from ``recipe.source``; returns (and
    writes to ``bootstrap.json``) what was done."""
    from transformers import AutoTokenizer

    source_model = Path(recipe.source)
    if not (source_model / "config.json").is_file():
        if recipe.source != BootstrapConfig().source:
            raise SystemExit(f"bootstrap.source = {recipe.source!r} has no config.json")
        from starting_points.tiny_model import build_tiny_model

        log(f"building the tiny model in {source_model}")
        build_tiny_model(source_model)
    began = time.perf_counter()
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source_model, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    chat = ChatFormat(tokenizer, actors.compaction, actors.environment)
    log(f"playing {recipe.demonstrations} demonstration episodes "
        f"(drop_fact_probability {recipe.drop_fact_probability})")
    segments, results = asyncio.run(demonstrate(chat, actors, recipe))
    demonstrated = time.perf_counter()
    success = sum(r.stats.success for r in results) / len(results)
    compactions = sum(r.stats.compactions for r in results) / len(results)
    log(f"  {len(segments)} segments, success {success:.3f}, "
        f"{compactions:.2f} compactions per episode")
    curve = fine_tune(out, segments, recipe, log)
    held_out, _ = asyncio.run(demonstrate(chat, actors, recipe, held_out=HELD_OUT_DEMONSTRATIONS))
    copying = copy_accuracy(out, chat, held_out, _keyvault(actors).ordered)
    log(f"  copy accuracy on {HELD_OUT_DEMONSTRATIONS} held-out demonstrations: summaries "
        f"{copying['summary']:.3f}, answers {copying['answer']:.3f}")
    report = {
        "source_model": str(source_model),
        **made_for(actors, recipe),
        "demonstrations": {"episodes": len(results), "segments": len(segments),
                           "trained_tokens": sum(s.num_trainable for s in segments),
                           "success": success, "compactions_per_episode": compactions},
        "loss_curve": curve,
        "copy_accuracy": copying,
        "seconds": {"demonstrations": demonstrated - began,
                    "fine_tune": time.perf_counter() - demonstrated},
    }
    (out / "bootstrap.json").write_text(json.dumps(report, indent=2))
    return report
