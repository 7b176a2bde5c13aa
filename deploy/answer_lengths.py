"""How often a KeyVault policy's answers list more digits than its code has.

KeyVault's partial credit with ``ordered = false`` (the local default) counts
the code's digits an answer contains: an answer listing many digits scores
1.0 without being the exact answer (``success`` false). This reads the final
answers a run trained on from its replay log (what the log still holds:
records the log's compaction removed are not seen) and reports, per run
folder, the fraction of them listing more digits than ``codes x digits``
(from the run's configuration), over its first and its last ``--window``
answers: a policy that learned to game the partial credit shows as a rise.

    python -m deploy.answer_lengths RUN [RUN ...] [--window 500] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from pathlib import Path

import msgspec
from transformers import AutoTokenizer

from actors.envs.keyvault import NUMBER_WORDS
from protocol import Segment, sampled_runs
from replay.log import SEGMENT, read_records

#: The wire schema of a segment is the same in protocol versions 3 and 4;
#: logs of either are read without the envelope's version check.
SEGMENT_DECODER = msgspec.msgpack.Decoder(Segment)


def answer_digits(text: str) -> int | None:
    """Digits listed after ``answer`` (numerals or words); None without an answer."""
    if "answer" not in text:
        return None
    words = re.findall(r"[a-z]+|\d", text.split("answer", 1)[1])
    return sum(word.isdigit() or word in NUMBER_WORDS[:10] for word in words)


def last_sampled_text(segment: Segment, tokenizer) -> str:
    """The segment's last run of sampled tokens (the episode's last action), as text."""
    runs = sampled_runs(segment.loss_mask.numpy())
    if not runs:
        return ""
    start, end = runs[-1]
    return tokenizer.decode(segment.tokens.numpy()[start:end]).lower()


def measure(run: Path, window: int) -> dict:
    config = tomllib.loads((run / "config.toml").read_text())
    options = config["actors"]["environment"]["options"]
    code_digits = int(options.get("codes", 2)) * int(options.get("digits", 4))
    tokenizer = AutoTokenizer.from_pretrained(config["run"]["model"])
    counts = []
    for kind, payload, _ in read_records((run / "replay" / "segments.log").read_bytes()):
        if kind != SEGMENT:
            continue
        segment = SEGMENT_DECODER.decode(payload)
        if not segment.final:
            continue
        listed = answer_digits(last_sampled_text(segment, tokenizer))
        if listed is not None:
            counts.append(listed)

    def over_long(part: list[int]) -> float | None:
        return round(sum(n > code_digits for n in part) / len(part), 3) if part else None

    return {"run": str(run), "answers": len(counts), "code_digits": code_digits,
            "over_long_first": over_long(counts[:window]),
            "over_long_last": over_long(counts[-window:])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (RUN/replay/segments.log)")
    parser.add_argument("--window", type=int, default=500, help="answers at each end")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = parser.parse_args()
    results = [measure(run, args.window) for run in args.runs]
    for result in results:
        print(f"{result['run']}: {result['answers']} answers; more than {result['code_digits']} "
              f"digits: first {args.window} {result['over_long_first']}, last "
              f"{args.window} {result['over_long_last']}")
    if args.json:
        print(json.dumps({"window": args.window, "runs": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
