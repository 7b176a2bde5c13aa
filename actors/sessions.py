"""Segments from a harness's calls: the recording endpoint's bookkeeping (no engine, no HTTP).

A harness we did not write drives the policy through the OpenAI-compatible
endpoint (actors/recording_endpoint.py); each of its sessions is one rollout. The
endpoint renders every call's messages to token ids (splicing in the
policy's recorded tokens for the assistant turns it wrote) and hands
:meth:`SessionRecord.record` the prompt and what was sampled. The segments
follow the contract of the actor's own loop (docs/protocol.md):

- a call whose prompt *extends* the open segment's tokens (the previous
  prompt, its completion and the new turns after it) continues that execution
  segment: the new prompt tokens are context (mask 0), the completion is
  trainable (mask 1, its behaviour log-probs and versions);
- a call whose prompt does not extend it closes the segment and opens a new
  one with the whole prompt as context: the harness rebuilt its context
  there, which is where it compacted;
- a call marked as a summarisation closes the open segment and is a summary
  segment of its own (prompt as context, the summary trainable); the next
  call opens a new execution segment.

A segment with no sampled token (nothing to train) is never emitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from actors.context import ClosedSegment, Generation


def extends(prompt: list[int], context: list[int]) -> bool:
    """Whether ``prompt`` starts with every token of ``context``."""
    return len(prompt) >= len(context) and prompt[:len(context)] == context


@dataclass
class SessionRecord:
    """One harness session (one rollout): its open segment and the counts of
    what it did. :meth:`record` returns the segments each call closes, in order."""

    session_id: str
    rollout_id: str
    started: float = field(default_factory=time.monotonic)
    last_call: float = field(default_factory=time.monotonic)
    calls: int = 0
    summaries: int = 0
    rebuilds: int = 0
    """Calls that did not extend the open segment (the harness's own
    compactions, or any other rewrite of its history)."""
    generated_tokens: int = 0
    summary_tokens: int = 0
    _open: ClosedSegment | None = None

    def record(self, prompt: list[int], generation: Generation, summary: bool
               ) -> list[ClosedSegment]:
        """The call of ``prompt`` that sampled ``generation``; ``summary``:
        the harness marked it a summarisation."""
        self.calls += 1
        self.last_call = time.monotonic()
        self.generated_tokens += len(generation.token_ids)
        current = self._open
        extending = current is not None and extends(prompt, current.tokens)
        closed = [] if current is None or extending and not summary else [current]
        if summary:
            self.summaries += 1
            self.summary_tokens += len(generation.token_ids)
            segment = ClosedSegment("summary")
            segment.append_context(prompt)
            segment.append_sampled(generation)
            closed.append(segment)
            self._open = None
        else:
            if extending:
                current.append_context(prompt[len(current.tokens):])
            else:
                self.rebuilds += current is not None
                current = ClosedSegment("execution")
                current.append_context(prompt)
            current.append_sampled(generation)
            self._open = current
        return self._emitted(closed)

    def finish(self) -> ClosedSegment | None:
        """Close the session: its open segment, the rollout's last (None if
        it has none with sampled tokens)."""
        last, self._open = self._open, None
        kept = self._emitted([last] if last is not None else [])
        return kept[0] if kept else None

    @staticmethod
    def _emitted(segments: list[ClosedSegment]) -> list[ClosedSegment]:
        return [segment for segment in segments if segment.num_trainable]
