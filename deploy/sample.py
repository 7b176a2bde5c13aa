"""``compactionrl model sample``: generate from a model with vLLM, optionally
checking the engine's log-probabilities against transformers."""

from __future__ import annotations

import json
import time

from actors.config import EngineConfig
from actors.engine import engine_kwargs, engine_process_started, quiet_vllm_logging
from deploy.model_check import BF16_LOGPROB_TOLERANCE, compare

#: float32 engines agree with the float32 reference to rounding noise.
FLOAT32_LOGPROB_TOLERANCE = 1e-3


def sample(model: str, engine: EngineConfig, *, prompt: str, max_tokens: int,
           temperature: float, num_prompts: int, check: bool, as_json: bool) -> int:
    quiet_vllm_logging()  # stdout holds only this command's report
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=engine.trust_remote_code)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    start = time.perf_counter()
    with engine_process_started(engine):
        llm = LLM(**engine_kwargs(model, engine))
    started_s = time.perf_counter() - start
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0,
                            ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt_ids}] * num_prompts
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up: the first batch is slow
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    first = outputs[0].outputs[0]
    completion = list(first.token_ids)
    logprobs = [first.logprobs[i][t].logprob for i, t in enumerate(completion)]
    llm.llm_engine.engine_core.shutdown()
    report = {
        "model": model, "dtype": engine.dtype, "engine_start_s": round(started_s, 2),
        "prompt_tokens": len(prompt_ids), "completion": tokenizer.decode(completion),
        "completion_tokens": completion[:16], "logprobs": [round(x, 4) for x in logprobs[:16]],
        "generated_tokens_per_s": round(generated / generate_s, 1),
    }
    ok = True
    if check:
        import torch
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32, trust_remote_code=engine.trust_remote_code)
        tolerance = (FLOAT32_LOGPROB_TOLERANCE if engine.dtype == "float32"
                     else BF16_LOGPROB_TOLERANCE)
        agreement = compare(reference, prompt_ids, completion, logprobs, tolerance, temperature)
        ok = agreement.max_logprob_error <= tolerance and agreement.greedy_mismatches == 0
        report["check"] = {"max_logprob_error": agreement.max_logprob_error,
                           "tolerance": tolerance,
                           "greedy_mismatches": agreement.greedy_mismatches, "ok": ok}
    if as_json:
        print(json.dumps(report))
    else:
        print_report(report, engine.dtype, f"{num_prompts} x {max_tokens}")
    return 0 if ok else 1


def print_report(report: dict, dtype: str, workload: str) -> None:
    """The report for a reader (``workload``: "prompts x tokens")."""
    print(f"engine started in {report['engine_start_s']:.1f} s ({dtype}); "
          f"prompt {report['prompt_tokens']} tokens")
    print(f"completion: {report['completion']!r}")
    print(f"first tokens: {report['completion_tokens']}")
    print(f"log-probs:    {report['logprobs']}")
    print(f"{workload} tokens at {report['generated_tokens_per_s']} tokens/s")
    if (c := report.get("check")) is not None:
        print(f"vs transformers: max |d log p| = {c['max_logprob_error']:.2e} "
              f"(tolerance {c['tolerance']}), greedy mismatches beyond ties: "
              f"{c['greedy_mismatches']} -> {'OK' if c['ok'] else 'DISAGREE'}")
