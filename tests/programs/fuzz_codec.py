"""Coverage-guided fuzzing of the wire decoder with atheris (libFuzzer)::

    python -m tests.programs.fuzz_codec --seconds 60 [--corpus DIR] [libFuzzer flags]

The property, whatever the bytes: ``decode`` returns a message or raises
``ProtocolError``, nothing else; a decoded message re-encodes to a frame
that decodes and re-encodes to the same bytes; a decoded segment's content
check (the replay's next step) also raises nothing but ``ProtocolError``.
Any other exception, a crash or more than 2 GiB of memory stops the run
with a non-zero exit and the input saved as ``DIR/crash-*``.

The corpus starts from one valid frame of every message kind. Coverage
guides the mutations through the project's own code (``protocol/``); the
C decoder of msgspec is not instrumented (that needs a clang build with
``-fsanitize=fuzzer``), so inside it libFuzzer mutates blind. Blind byte
flips almost never build deep nesting (a 1.3 KB frame of 1,100 nested
arrays once killed the replay), so half of the mutations are structural:
a run of nested array or map headers inserted anywhere.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["protocol"]):
    from protocol import (
        Ack,
        BatchRequest,
        EngineInfo,
        Error,
        GroupInfo,
        Heartbeat,
        Hello,
        LearnerHello,
        LearnerWelcome,
        MemberWelcome,
        Message,
        ProtocolError,
        Segment,
        Stamp,
        TensorSpec,
        WeightManifest,
        WeightsAnnounce,
        WeightsLoaded,
        Welcome,
        decode,
        encode,
    )
    from protocol.synthetic import synthetic_batch, synthetic_segment
    from protocol.validation import check_segment_content

#: The decoder's frame limit while fuzzing: inputs are far smaller, so every
#: length claim in them is a lie the decoder must catch.
MAX_MESSAGE_BYTES = 1 << 20


def seed_messages() -> list[Message]:
    """One valid message of every kind."""
    stamp = Stamp("actor-0", 1)
    return [
        Hello(**stamp.next(), engine=EngineInfo(device="cpu", dtype="bfloat16",
                                                tensor_parallel=1, model="m"), capacity=2,
              token=bytes(range(16))),
        Welcome(**stamp.next(), run_id="r", policy_version=3, heartbeat_interval_s=1.0,
                heartbeat_liveness=5, max_staleness=2, rollouts_per_batch=4, credits=2,
                credit_ledger=7, credits_total=2, max_message_bytes=1 << 20, vocab_size=100,
                stale_grace=0),
        MemberWelcome(**stamp.next(), run_id="r", policy_version=3, heartbeat_interval_s=1.0,
                      heartbeat_liveness=5),
        LearnerHello(**stamp.next()),
        LearnerWelcome(**stamp.next(), run_id="r", policy_version=3, rollouts_per_batch=4,
                       max_staleness=2),
        synthetic_segment(stamp, "r-0", 0, final=False, tokens=8),
        synthetic_segment(stamp, "r-0", 1, final=True, tokens=8),
        Ack(**stamp.next(), stored_seqs=[1, 2], credits=1, policy_version=3, credit_ledger=7,
            credits_total=3),
        Heartbeat(**stamp.next(), active_rollouts=1, stall_seconds={"credits": 0.5},
                  credit_ledger=7, credits_seen=3),
        BatchRequest(**stamp.next(), size=2, policy_version=3),
        synthetic_batch(rollouts=1),
        WeightsAnnounce(**stamp.next(), version=3,
                        manifest=WeightManifest(tensors=[TensorSpec("w", "float32", (2, 2))],
                                                bucket_bytes=0),
                        group=GroupInfo(generation=1, master_addr="h", master_port=1,
                                        world_size=2, rank=1, backend="gloo")),
        WeightsLoaded(**stamp.next(), version=3, seconds=0.25),
        Error(**stamp.next(), code="malformed", text="x", ref_seq=3),
    ]


#: The deepest run of nested containers a structural mutation inserts: past
#: the decoder's recursion limit (about 900 here) and well short of it.
MAX_INSERTED_DEPTH = 4_000
#: One level of nesting: an array of one, or a map of one whose key is "x".
NESTING_LEVELS = (b"\x91", b"\x81\xa1x", b"\xdc\x00\x01", b"\xde\x00\x01\xa1x")


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    """libFuzzer's own mutation, or every other time a run of nested
    containers (of one level kind, 1 to :data:`MAX_INSERTED_DEPTH` deep)
    inserted at a random place, ending in nil."""
    chance = random.Random(seed)
    if chance.random() < 0.5:
        return atheris.Mutate(data, max_size)
    level = chance.choice(NESTING_LEVELS)
    depth = min(chance.randint(1, MAX_INSERTED_DEPTH), max(1, (max_size - 1) // len(level)))
    at = chance.randint(0, len(data))
    return (data[:at] + level * depth + b"\xc0" + data[at:])[:max_size]


def test_one_input(data: bytes) -> None:
    try:
        message = decode(data, MAX_MESSAGE_BYTES)
    except ProtocolError:
        return
    frame = encode(message)
    assert encode(decode(frame, MAX_MESSAGE_BYTES)) == frame, "re-encoding is not stable"
    if isinstance(message, Segment):
        try:
            check_segment_content(message, vocab_size=100, oldest_version=0, newest_version=10)
        except ProtocolError:
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("::")[0])
    parser.add_argument("--seconds", type=int, default=60, help="how long to fuzz")
    parser.add_argument("--corpus", help="corpus folder (kept; default a new temporary one)")
    args, libfuzzer_flags = parser.parse_known_args(argv)
    corpus = Path(args.corpus or tempfile.mkdtemp(prefix="fuzz-codec-"))
    corpus.mkdir(parents=True, exist_ok=True)
    for n, message in enumerate(seed_messages()):
        (corpus / f"seed-{n}").write_bytes(encode(message))
    print(f"corpus and any crash inputs: {corpus}", flush=True)
    atheris.Setup([sys.argv[0], f"-max_total_time={args.seconds}", "-rss_limit_mb=2048",
                   f"-max_len={4 * MAX_INSERTED_DEPTH}",
                   f"-artifact_prefix={corpus}/crash-", *libfuzzer_flags, str(corpus)],
                  test_one_input, custom_mutator=mutate)
    atheris.Fuzz()  # exits the process: 0 when the time is up without a finding


if __name__ == "__main__":
    main()
