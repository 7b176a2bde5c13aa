"""Every message kind of the wire protocol (docs/design.md §3.5), one typed struct each.

All messages share the header fields of :class:`Message`; ``kind`` is the
MessagePack map key that tells them apart. Each struct documents its direction.
Encoding and decoding live in :mod:`protocol.codec`; decoding calls
:meth:`Message.validate`, so a decoded message has already been checked.

Usage::

    stamp = Stamp(sender_id="actor-3", incarnation=1)
    seg = Segment(**stamp.next(), rollout_id="r1", task_id="t1", index=0, ...)
    frame = encode(seg)
    assert decode(frame) == seg
"""

from __future__ import annotations

import itertools
import secrets
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec

from protocol.arrays import Array
from protocol.errors import ErrorCode, ProtocolError

#: The wire schema version; a peer speaking another one is rejected.
#: 2: credit ledgers in ``Welcome``, ``Ack`` and ``Heartbeat``.
#: 3: a handshake per peer kind (``LearnerHello`` / ``LearnerWelcome`` on the
#: replay's learner socket, ``MemberWelcome`` from the learner's control socket).
#: 4: ``Abandon`` (a rollout given up by a living actor).
#: 5: ``Welcome`` says the replay's frame bound, vocabulary and staleness
#: grace; header and segment fields have ranges (``invalid`` outside them).
#: 6: ``Hello`` carries the incarnation's token; a connection speaks only
#: after its ``Hello`` (clients set no routing id).
#: 7: ``Goodbye`` (an incarnation ending cleanly leaves at once, not after its
#: heartbeats stop); ``Hello`` carries the actor's metrics address.
#: 8: rollouts have groups (``Segment.group``, ``Abandon.group``, ``Hello.group_size``):
#: the replay serves a group's rollouts together and grants credits in whole groups.
PROTOCOL_VERSION = 8

#: The ``sender_id`` of the learner (its rank 0), the one client the
#: replay's learner socket serves.
LEARNER_ID = "learner"
#: Longest ``sender_id`` and ``rollout_id``, in characters.
MAX_ID_CHARS = 256
#: Bound of ``incarnation`` and ``seq`` (a signed 64-bit integer, as the
#: replay's bookkeeping and MessagePack's int64 hold them).
MAX_COUNTER = 2**63 - 1
#: Segments a rollout may have (``index`` below it).
MAX_SEGMENTS = 2**31
#: Bounds of ``Hello.token``, in bytes: 16 is 128 bits, beyond guessing.
MIN_TOKEN_BYTES, MAX_TOKEN_BYTES = 16, 64
#: Most episodes one actor runs at once (``Hello.capacity``, ``Heartbeat.active_rollouts``):
#: the replay shares credits by capacity, and one peer's word must not outweigh a fleet's.
MAX_CAPACITY = 65_536
#: Most rollouts in one group (``Hello.group_size``, ``GroupTag.size``): at most the actor's
#: capacity, since the replay grants a group's credits together.
MAX_GROUP_SIZE = 1024
#: Most engine workers of one actor (``EngineInfo.tensor_parallel``), each a weight-group rank.
MAX_TENSOR_PARALLEL = 1024
#: Most labels of a rollout's ``stats.tags`` (and entries of its ``stats.info``),
#: and their keys' and text values' lengths.
MAX_TAGS, MAX_TAG_CHARS = 64, 256
#: Most reasons in ``Heartbeat.stall_seconds``.
MAX_STALL_REASONS = 16
#: Longest ``Error.text``, in characters.
MAX_ERROR_TEXT = 500
#: Longest model name or folder (``EngineInfo.model``): a path's limit on Linux.
MAX_PATH_CHARS = 4096

# The ranges of the wire's fields, declared on their types: msgspec checks them
# while it decodes, and the codec answers a value outside one ``invalid``
# (protocol/codec.py). docs/protocol.md's field tables are generated from them.
_FLOAT_MAX = sys.float_info.max
#: An integer in [0, 2^63): counters, versions, sizes.
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNTER)]
#: A positive count, in [1, 2^63).
Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNTER)]
#: A finite number (neither NaN nor infinite).
Finite = Annotated[float, msgspec.Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]
#: A finite number >= 0 (durations, mean staleness).
NonNegative = Annotated[float, msgspec.Meta(ge=0, le=_FLOAT_MAX)]
#: A finite number of seconds, > 0.
Interval = Annotated[float, msgspec.Meta(gt=0, le=_FLOAT_MAX)]
#: What an identifier may hold: no control character (C0, DEL, C1) nor line or
#: paragraph separator, so that one written into a log line can neither end it
#: nor forge the next one.
PRINTABLE = "\\A[^\\x00-\\x1f\\x7f-\\x9f\\u2028\\u2029]*\\Z"
#: An identifier: ``sender_id``, ``rollout_id``, ``task_id``, ``run_id``.
Identifier = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS,
                                         pattern=PRINTABLE)]
#: The floating-point dtypes weights may travel in, as torch names them: the
#: names of ``protocol.weights.WIRE_FLOAT_DTYPES`` (this module imports no torch),
#: and so the dtypes an engine may declare (``EngineInfo.dtype``).
WireDtype = Literal["float32", "bfloat16", "float16", "float64"]
#: A key of ``stats.tags`` or ``stats.info``, and a text value of either.
TagKey = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TAG_CHARS)]
TagText = Annotated[str, msgspec.Meta(max_length=MAX_TAG_CHARS)]


def new_token() -> bytes:
    """A fresh incarnation's ``Hello.token``: the shortest allowed, random."""
    return secrets.token_bytes(MIN_TOKEN_BYTES)

SegmentType = Literal["execution", "summary"]
EpisodeOutcome = Literal[
    "done",  # the environment ended the episode
    "step_limit",
    "compaction_limit",
    "context_full",  # compaction disabled (or impossible) and the window is full
    "compaction_failed",  # the rebuilt context would not leave the reserve free
    "error",  # the environment or the engine failed; reward is 0
]


# gc=False, here and on every struct below: a message is a tree, never a
# cycle, and the replay holds tens of thousands; tracked, the collector's passes
# over them cost a third of its CPU per segment at 1,024 actors (bench/replay_scale.py).
class Message(msgspec.Struct, tag_field="kind", kw_only=True, gc=False):
    """The common header. ``seq`` increases by one per message a sender sends
    in one incarnation; ``(sender_id, incarnation, seq)`` identifies a message."""

    protocol_version: int = PROTOCOL_VERSION
    """The schema version the sender speaks; any other is refused (``protocol_version``)."""
    sender_id: Identifier
    """The sending process (``actor-3``, ``replay``, ``learner``). On the
    replay's actor socket and the learner's control socket a connection speaks for the actor
    incarnation whose ``hello`` registered it (anything else is ``unregistered``); ``learner``
    is the learner's alone. Like every identifier (each field of 1 to 256 characters but
    ``metrics_address``), it holds no control character, nor a line or paragraph separator
    (``invalid``): it is written into logs."""
    incarnation: Count
    """Changes each time the sender restarts or registers anew; a restarted actor takes a larger
    one."""
    seq: Count
    """+1 per message within one incarnation: ``(sender_id, incarnation, seq)`` identifies a
    message, and a reply's ``ref_seq`` names it. A receiver takes gaps (a message lost with a
    connection leaves one, and a restarted actor continues its seqs) and never reorders by it:
    a seq already stored is a resend."""
    sent_at: Finite
    """Sender's wall clock, seconds since the epoch."""

    def validate(self) -> None:
        """Raise :class:`ProtocolError` if the message is semantically invalid.
        Called by the decoder; kinds with invariants beyond types override it."""


class Stamp:
    """Produces header fields for one sender: ``Hello(**stamp.next(), ...)``.

    ``first_seq``: a process that starts a new incarnation continues its seqs
    (``Stamp(id, new, first_seq=old.next_seq)``), so that a reply naming a
    ``ref_seq`` tells which of its incarnations it is about."""

    def __init__(self, sender_id: str, incarnation: int, first_seq: int = 0) -> None:
        self.sender_id = sender_id
        self.incarnation = incarnation
        self.first_seq = first_seq
        self.next_seq = first_seq

    def next(self) -> dict[str, Any]:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return {
            "sender_id": self.sender_id,
            "incarnation": self.incarnation,
            "seq": seq,
            "sent_at": time.time(),
        }


# --------------------------------------------------------------------------- actor <-> replay


class EngineInfo(msgspec.Struct, kw_only=True, gc=False):
    """What an actor runs on; the replay and dashboards show it per actor."""

    device: Identifier
    """``cpu``, or the accelerator's name (``NVIDIA H100 80GB HBM3``)."""
    dtype: WireDtype
    """The engine's parameter dtype as torch names it: weights travel to it in this dtype, so
    it is one they may travel in (``protocol.weights.WIRE_FLOAT_DTYPES``)."""
    tensor_parallel: Annotated[int, msgspec.Meta(ge=1, le=MAX_TENSOR_PARALLEL)]
    """Engine workers (tensor-parallel ranks), each one rank of the weight group."""
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH_CHARS)]
    """The model folder or name the engine started from."""


class Hello(Message, tag="hello"):
    """actor -> replay and learner: registration (first message of an incarnation)."""

    engine: EngineInfo
    """What the actor runs on: the learner sends it weights in its dtype, one group rank per
    tensor-parallel worker."""
    capacity: Annotated[int, msgspec.Meta(ge=1, le=MAX_CAPACITY)]
    """How many episodes the actor runs concurrently."""
    token: Annotated[bytes, msgspec.Meta(min_length=MIN_TOKEN_BYTES, max_length=MAX_TOKEN_BYTES)]
    """16 to 64 random bytes drawn once per incarnation and sent only in its ``hello``s: the
    incarnation's ``hello`` on a new connection (a reconnect) moves it there only if it
    carries the token of its first ``hello``, else ``identity``."""
    policy_version: Annotated[int, msgspec.Meta(ge=-1, le=MAX_COUNTER)] = 0
    """Version of the weights the actor's engine holds (0 = the starting model;
    ``NO_COMPLETE_VERSION``: a weight load failed midway, the engine holds a mix
    and waits, paused, for the next publication)."""
    metrics_address: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] = ""
    """``host:port`` of the actor's Prometheus ``/metrics``, as the replay's side of the
    network reaches it (at most 256 characters, port 1 to 65535): the replay lists it for
    Prometheus's file-based discovery while the incarnation is registered. Empty: none."""
    group_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_GROUP_SIZE)] = 1
    """G: rollouts the actor starts in each of its groups (``Segment.group``), at most its
    ``capacity``: the replay grants its credits in multiples of G, so that every group it
    starts can finish (docs/replay.md, "Groups")."""

    def validate(self) -> None:
        if self.sender_id == LEARNER_ID:
            raise ProtocolError(ErrorCode.IDENTITY, f"sender_id {LEARNER_ID!r} is the learner's: "
                                "no actor registers under it")
        if self.group_size > self.capacity:
            raise ProtocolError(ErrorCode.INVALID, f"group_size {self.group_size} > capacity "
                                f"{self.capacity}: a group's credits are granted together")
        if self.metrics_address and not valid_host_port(self.metrics_address):
            raise ProtocolError(ErrorCode.INVALID, f"metrics_address "
                                f"{self.metrics_address[:64]!r} is not host:port")


def valid_host_port(address: str) -> bool:
    """``host:port`` with a port in [1, 65535], at most ``MAX_ID_CHARS`` long
    (an IPv6 host in brackets, as Prometheus writes targets)."""
    host, _, port = address.rpartition(":")
    return (len(address) <= MAX_ID_CHARS and bool(host) and port.isascii() and port.isdigit()
            and 0 < int(port) < 65536 and not any(c.isspace() for c in host))


NO_COMPLETE_VERSION = -1
"""``Hello.policy_version`` of an engine whose weights are a mix of two versions."""


class Welcome(Message, tag="welcome"):
    """replay -> actor: the run's facts the actor needs, and its credit
    ledger, as in ``Ack``."""

    run_id: Identifier
    """The run's name, the same for every process of a run."""
    policy_version: Count
    """The newest version the learner has asked with."""
    heartbeat_interval_s: Interval
    """Seconds between the actor's heartbeats."""
    heartbeat_liveness: Positive
    """Intervals of silence after which the replay counts the actor dead."""
    max_staleness: Count
    """The bound S, whose one source is the replay's configuration: a rollout whose oldest
    trainable token is more than S versions behind the learner is dropped, and the actor
    waits for weights when it is more than S versions behind."""
    rollouts_per_batch: Positive
    """B: the batch size the learner asks for (for reading: what a credit is worth)."""
    credits: Count
    """Rollouts the actor may start now: its share of the credits free (more arrive with each
    ``Ack``); 0 when the actors before it hold them all (docs/replay.md, "Who gets the
    credits")."""
    credit_ledger: Count
    """As in ``ack``."""
    credits_total: Count
    """As in ``ack``."""
    max_message_bytes: Positive
    """The largest frame the replay takes (``transport.max_message_bytes``): a longer one costs
    the sender its connection, unanswered."""
    vocab_size: Positive
    """Token ids must be below it (``invalid`` otherwise)."""
    stale_grace: Count
    """Versions past ``max_staleness`` a rollout that was ready in time is still served at."""


class MemberWelcome(Message, tag="member_welcome"):
    """learner -> actor: the answer to ``hello`` on the learner's control
    socket; the actor is a member of the weight groups from now on."""

    run_id: Identifier
    """The run's name, the same for every process of a run."""
    policy_version: Count
    """The learner's current version: the actor waits for weights while its own is more
    than the replay's ``max_staleness`` behind it."""
    heartbeat_interval_s: Interval
    """Seconds between the actor's heartbeats to the learner."""
    heartbeat_liveness: Positive
    """Intervals of silence after which the learner counts the actor gone."""


class RolloutStats(msgspec.Struct, kw_only=True, gc=False):
    """Episode summary sent with the final segment of a rollout."""

    outcome: EpisodeOutcome
    """How the episode ended."""
    success: bool
    """Whether the environment counts the task solved."""
    steps: Count
    """Environment steps taken."""
    compactions: Count
    """Times the context was compacted."""
    generated_tokens: Count
    """Tokens the policy generated, actions and summaries."""
    summary_tokens: Count
    """Of those, the summaries'."""
    duration_s: NonNegative
    """Wall time of the episode, seconds."""
    tags: Annotated[dict[TagKey, TagText], msgspec.Meta(max_length=MAX_TAGS)] = {}
    """The task's labels (``Task.tags``: task family, difficulty, ...), which
    the learner's metrics and evaluation reports group by. May be omitted."""
    info: Annotated[dict[TagKey, TagText | bool | Finite], msgspec.Meta(max_length=MAX_TAGS)] = {}
    """The environment's ``info`` of the step that ended the episode (the
    parts of its reward: KeyVault's digits right and attempts, a rubric's
    metrics), as :func:`wire_info` flattens it; the rollout viewer shows it.
    May be omitted."""

    def check(self) -> None:
        """Summary tokens are among the generated ones (``invalid``); the
        other fields' ranges are their types'."""
        if self.summary_tokens > self.generated_tokens:
            raise ProtocolError(ErrorCode.INVALID, f"stats.summary_tokens {self.summary_tokens} "
                                f"> generated_tokens {self.generated_tokens}")


def wire_info(info: Mapping[str, Any], prefix: str = "") -> dict[str, str | bool | float]:
    """An environment's ``info`` as ``RolloutStats.info`` carries it: nested
    mappings flattened to dotted keys, numbers as finite floats, truth values
    kept, anything else (a list, None, NaN) as its text; keys and texts cut to
    :data:`MAX_TAG_CHARS`, the first :data:`MAX_TAGS` entries kept."""
    flat: dict[str, str | bool | float] = {}
    for key, value in info.items():
        name = f"{prefix}{key}"[:MAX_TAG_CHARS]
        if isinstance(value, Mapping):
            flat.update(wire_info(value, f"{name}."))
        elif isinstance(value, bool):
            flat[name] = value
        elif isinstance(value, int | float) and abs(value) <= _FLOAT_MAX:  # not NaN either
            flat[name] = float(value)
        else:
            flat[name] = str(value)[:MAX_TAG_CHARS]
    return dict(itertools.islice(((k, v) for k, v in flat.items() if k), MAX_TAGS))


def sampled_runs(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of sampled tokens (``loss_mask`` 1) of a
    segment, in order: its actions, or its summary."""
    runs: list[tuple[int, int]] = []
    for index, sampled in enumerate(loss_mask):
        if sampled and runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        elif sampled:
            runs.append((index, index + 1))
    return runs


class GroupTag(msgspec.Struct, kw_only=True, gc=False):
    """The group a rollout belongs to (``advantage = grpo`` compares a group's rewards): the
    rollouts of one actor incarnation that carry the same ``id``."""

    id: Identifier
    """1 to 256 characters, unique within the actor incarnation."""
    size: Annotated[int, msgspec.Meta(ge=1, le=MAX_GROUP_SIZE)]
    """G, the rollouts the actor starts in the group: its ``Hello.group_size`` (``invalid``
    otherwise)."""


class Segment(Message, tag="segment"):
    """actor -> replay: one execution window or one summary (docs/design.md §2.2).

    All four arrays have one entry per token. Non-trainable tokens (prompt,
    observations, kept steps) have ``loss_mask`` 0; their ``logprobs`` and
    ``versions`` are ignored (by convention 0 and -1).
    """

    rollout_id: Identifier
    """1 to 256 characters, unique within the run (actors use their id, incarnation and a
    counter); every segment of a rollout carries it. The rollout belongs to the actor
    incarnation whose segment of it came first: another's segment or abandon of it is refused
    (``owner``)."""
    task_id: Identifier
    """The task the episode plays."""
    index: Annotated[int, msgspec.Meta(ge=0, lt=MAX_SEGMENTS)]
    """Position of the segment in its rollout, in [0, 2^31)."""
    segment_type: SegmentType
    """``execution``: a context window of actions and observations; ``summary``: the summary the
    policy wrote when it compacted (never at index 0: it summarises a window before it)."""
    tokens: Array
    """int32 [T] token ids, T >= 1."""
    loss_mask: Array
    """uint8 [T], 1 for trainable (policy-sampled) tokens."""
    logprobs: Array
    """float32 [T], behaviour log-probability of each sampled token."""
    versions: Array
    """int32 [T], policy version that sampled each token."""
    final: bool
    """The last segment of the rollout; carries ``reward`` and ``stats``."""
    reward: Finite | None = None
    """The rollout's final reward, a finite number: present exactly on the final segment (omitted
    or nil on the others)."""
    stats: RolloutStats | None = None
    """The episode's summary, on the final segment only (counts >= 0, ``summary_tokens`` <=
    ``generated_tokens``, a finite ``duration_s`` >= 0); omitted or nil, the learner counts
    success as reward > 0 and compactions from the segments."""
    token_rewards: Array | None = None
    """float32 [T], per-step rewards the environment gave, each on the last sampled token of the
    action that earned it (0 elsewhere; never on a token with loss_mask 0). Omitted or nil: none.
    The learner adds them to GAE's per-token rewards beside the final reward."""
    group: GroupTag | None = None
    """The rollout's group, the same on every segment of it (``invalid`` otherwise): the replay
    serves a group's rollouts in one batch (docs/replay.md, "Groups"). Omitted or nil: a group
    of its own."""

    def validate(self) -> None:
        """Structure only (O(1), no pass over the data); the contents are
        checked against the run by :func:`protocol.validation.check_segment_content`."""
        expected = {"tokens": "int32", "loss_mask": "uint8", "logprobs": "float32",
                    "versions": "int32"}
        for name, dtype in expected.items():
            array: Array = getattr(self, name)
            array.check(name)
            if array.dtype != dtype or len(array.shape) != 1:
                raise ProtocolError(ErrorCode.ARRAY, f"{name}: expected 1-D {dtype}, "
                                    f"got {array.dtype}{list(array.shape)}")
        if self.token_rewards is not None:
            self.token_rewards.check("token_rewards")
            if self.token_rewards.dtype != "float32" or len(self.token_rewards.shape) != 1:
                raise ProtocolError(ErrorCode.ARRAY, "token_rewards: expected 1-D float32, got "
                                    f"{self.token_rewards.dtype}{list(self.token_rewards.shape)}")
            expected["token_rewards"] = "float32"
        lengths = {name: getattr(self, name).shape[0] for name in expected}
        if len(set(lengths.values())) != 1:
            raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"per-token arrays differ: {lengths}")
        if lengths["tokens"] == 0:
            raise ProtocolError(ErrorCode.INVALID, "a segment of no tokens")
        if self.index == 0 and self.segment_type == "summary":
            raise ProtocolError(ErrorCode.INVALID, "a rollout starts with an execution "
                                "segment: a summary summarises one before it")
        if self.final != (self.reward is not None):
            raise ProtocolError(ErrorCode.INVALID,
                                "reward must be present exactly on the final segment")
        if self.stats is not None:
            if not self.final:
                raise ProtocolError(ErrorCode.INVALID, "stats on a segment that is not final")
            self.stats.check()


class Abandon(Message, tag="abandon"):
    """actor -> replay: a rollout that will never finish, though its actor
    lives on (a harness session given up or idle past its timeout, at the
    recording endpoint). The replay drops what it holds of it (counted
    ``crl_replay_dropped_total{reason="abandoned"}``) and returns its credit;
    its later segments are late. Acknowledged like a segment: its seq in an
    ``Ack``'s ``stored_seqs``, resent until then. Not written to the replay's
    log: after a replay restart, the rollout's logged segments expire after
    ``rollout_timeout_s``."""

    rollout_id: Identifier
    """The rollout given up, as in its segments."""
    group: GroupTag | None = None
    """Its group, as its segments would carry it: a member given up before its first segment
    arrived still settles its group. Omitted or nil: none."""


class Goodbye(Message, tag="goodbye"):
    """actor -> replay and learner: the incarnation ends cleanly; its last
    message on each socket (no reply). The learner drops it from the member
    set at once, so that its next publication neither waits for it nor fails
    on it; the replay drops the rollouts it left unfinished (counted
    ``crl_replay_dropped_total{reason="abandoned"}``), returns its credits to
    the other actors, and refuses the incarnation from then on
    (``dead_incarnation``). An actor sends it to the replay only once every
    segment it sent is acknowledged. A lost ``goodbye`` costs what silence
    does: the liveness timeout."""


class Ack(Message, tag="ack"):
    """replay -> actor: the segments now stored (durably, when the log is on),
    the credits granted with this reply, and the learner's version."""

    stored_seqs: list[Count]
    """The seqs of the receiver's segments now stored (durably, with the replay's log on), a
    resent duplicate's too: the actor may forget them."""
    credits: Count
    """Granted with this reply (for reading; the actor counts by the ledger)."""
    policy_version: Count
    """The newest version the learner has asked with."""
    credit_ledger: Count
    """The replay's account of this actor's credits: a new id voids the credits
    held under the old one (the replay restarted, or it forgot the actor)."""
    credits_total: Count
    """Credits granted under ``credit_ledger`` so far. The actor credits itself
    the part it has not seen, so a reply lost with a connection loses none."""


#: The reasons an actor's episodes wait (``Heartbeat.stall_seconds``' keys):
#: for fresh enough weights, for a rollout credit, for a summary to be written.
STALL_REASONS = ("weights", "credits", "summary")


class Heartbeat(Message, tag="heartbeat"):
    """actor -> replay and learner: liveness, with the actor's own counters."""

    active_rollouts: Annotated[int, msgspec.Meta(ge=0, le=MAX_CAPACITY)]
    """Episodes the actor is running now."""
    stall_seconds: Annotated[dict[Identifier, NonNegative],
                             msgspec.Meta(max_length=MAX_STALL_REASONS)]
    """Cumulative stall seconds of this incarnation by reason (``weights``, ``credits``,
    ``summary``; the replay counts the increase of each per actor, from the incarnation's
    first heartbeat it hears, which only sets the starting totals, together with the slot
    time since the last heartbeat, and ignores other keys)."""
    credit_ledger: Count
    """The replay's ledger id as last received (0: none yet)."""
    credits_seen: Count
    """The replay's ledger and total as last received: when behind, the
    replay repeats them (a reply carrying credits was lost)."""


# --------------------------------------------------------------------------- learner <-> replay


class LearnerHello(Message, tag="learner_hello"):
    """learner rank 0 -> replay: registration on the learner socket, the first
    message of a learner incarnation; answered with ``learner_welcome``."""


class LearnerWelcome(Message, tag="learner_welcome"):
    """replay -> learner: the run's facts the learner takes from the replay."""

    run_id: Identifier
    """The run's name, the same for every process of a run."""
    policy_version: Count
    """The newest version a learner has asked with (an earlier learner process of the run,
    if any): a resumed learner labels its weights above it."""
    rollouts_per_batch: Positive
    """B: the rollouts of each ``batch_request`` (the replay's configuration is the source)."""
    max_staleness: Count
    """S, as in ``welcome``: the learner tells an actor more than S versions behind that it
    needs weights at once."""


class BatchRequest(Message, tag="batch_request"):
    """learner -> replay: ask for ``size`` complete rollouts; it also says the
    batch before arrived (the replay releases it). ``size`` 0: only that (the
    learner's last word)."""

    size: Count
    """Rollouts wanted, at most the replay's ``rollouts_per_batch`` (B; ``invalid`` above it, and
    the batch before stays unreleased); 0 wants none and only releases the batch before (no
    reply comes)."""
    policy_version: Count
    """The learner's current version: the replay measures staleness and its version window from
    it. The version clock V (the largest heard) only moves forward: a learner incarnation's first
    request may set it anywhere in range, each later one to V + 1 at most once a batch was served
    since V moved (``invalid`` above; docs/protocol.md, "The version clock")."""


class Rollout(msgspec.Struct, kw_only=True, gc=False):
    """A complete rollout: its segments in index order, the last one final."""

    rollout_id: Identifier
    """As in its segments."""
    staleness: Count
    """Learner version minus the oldest version among its trainable tokens."""
    segments: list[Segment]
    """The rollout's segments as the actor sent them, in index order, the last one final."""

    def validate(self) -> None:
        if not self.segments:
            raise ProtocolError(ErrorCode.INVALID, f"rollout {self.rollout_id} has no segment")
        for expected_index, segment in enumerate(self.segments):
            segment.validate()
            if segment.rollout_id != self.rollout_id or segment.index != expected_index:
                raise ProtocolError(ErrorCode.INVALID, f"rollout {self.rollout_id}: "
                                    f"segment {expected_index} out of place")
            if segment.final != (expected_index == len(self.segments) - 1):
                raise ProtocolError(ErrorCode.INVALID,
                                    f"rollout {self.rollout_id}: final flag on a non-last segment")


class StalenessStats(msgspec.Struct, kw_only=True, gc=False):
    """Staleness (in learner versions) over the rollouts of one batch."""

    min: Count
    """Smallest."""
    max: Count
    """Largest."""
    mean: NonNegative
    """Mean."""
    p50: NonNegative
    """Median."""
    p95: NonNegative
    """95th percentile."""


class Batch(Message, tag="batch"):
    """replay -> learner: complete rollouts within the staleness bound."""

    policy_version: Count
    """The learner version the staleness is measured against."""
    rollouts: list[Rollout]
    """Complete rollouts, as many as asked."""
    staleness: StalenessStats
    """Over the batch's rollouts."""

    def validate(self) -> None:
        for rollout in self.rollouts:
            rollout.validate()


class FramedRollout(msgspec.Struct, kw_only=True, gc=False):
    """A ``Rollout`` as the replay encodes it: each segment the frame its
    actor sent, as stored, written verbatim (a ``msgspec.Raw``) instead of
    decoded and encoded again. The learner decodes it as a ``Rollout``."""

    rollout_id: Identifier
    staleness: Count
    segments: list[msgspec.Raw]


class FramedBatch(Message, tag="batch"):
    """A ``batch`` as the replay encodes it (its rollouts
    :class:`FramedRollout`); on the wire and to its reader a :class:`Batch`."""

    policy_version: Count
    rollouts: list[FramedRollout]
    staleness: StalenessStats


# --------------------------------------------------------------------------- learner <-> actors


class TensorSpec(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """One parameter of a weight publication, in broadcast order."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH_CHARS)]
    """The parameter's name in the engine's model."""
    dtype: Identifier
    """Its dtype on the wire, as torch names it."""
    shape: tuple[Count, ...]
    """Its shape."""


class WeightManifest(msgspec.Struct, kw_only=True, gc=False):
    """What a broadcast carries and how it is cut. Sender and receivers both
    use this, never a locally derived value."""

    tensors: list[TensorSpec]
    """Every tensor of the publication, in broadcast order."""
    bucket_bytes: Count
    """Tensors are packed into flat buffers of at most this many bytes (0 =
    one broadcast per tensor)."""


class GroupInfo(msgspec.Struct, kw_only=True, gc=False):
    """How to join the weight-broadcast process group of one generation."""

    generation: Count
    """+1 whenever the group is formed again (the members changed, or a publication failed)."""
    master_addr: Identifier
    """Host of the learner's rendezvous store."""
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    """Its port."""
    world_size: Annotated[int, msgspec.Meta(ge=2, le=2**31 - 1)]
    """Ranks in the group: the learner's and one per engine worker of every member."""
    rank: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 2)]
    """This actor's first rank (one per engine worker, consecutive)."""
    backend: Literal["gloo", "nccl", "ipc"]
    """The weight transport (protocol/weights.py): a broadcast, or staging
    buffers mapped by the engine (ipc: the engine on learner rank 0's host or GPU)."""
    timeout_s: Interval = 30.0
    """Bound on joining and on each broadcast: a dead member fails the
    publication after this long instead of hanging it."""


class WeightsAnnounce(Message, tag="weights_announce"):
    """learner rank 0 -> actor: a new version is about to be broadcast."""

    version: Count
    """The version the publication carries."""
    manifest: WeightManifest
    """What it carries."""
    group: GroupInfo
    """How to join the group it travels on."""


class WeightsLoaded(Message, tag="weights_loaded"):
    """actor -> learner: the engine now generates with ``version``."""

    version: Count
    """The version the engine now generates with: the one last announced to this member,
    reported once (any other report, or the same again, is ``invalid`` and counts nowhere)."""
    seconds: NonNegative
    """From the announcement to then."""


# --------------------------------------------------------------------------- any


class Error(Message, tag="error"):
    """Any -> any: a message was rejected. ``code`` is a :class:`ErrorCode` value
    or a service-specific code; ``ref_seq`` is the rejected message's seq when
    it could be read."""

    code: Identifier
    """An ``ErrorCode`` value (Rejection)."""
    text: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_TEXT)]
    """What exactly, for people (at most 500 characters)."""
    ref_seq: Count | None = None
    """The refused message's ``seq`` when its header decoded; nil otherwise."""


MESSAGE_TYPES: tuple[type[Message], ...] = (
    Hello, Welcome, MemberWelcome, Segment, Abandon, Goodbye, Ack, Heartbeat, LearnerHello,
    LearnerWelcome,
    BatchRequest, Batch, WeightsAnnounce, WeightsLoaded, Error,
)
