"""The learner process, one per torchrun rank.

Rank 0 talks to the replay: ``LearnerHello`` (the ``LearnerWelcome`` says the
batch size, the staleness bound and the newest version the replay knows),
then for each step a ``BatchRequest`` and the ``Batch`` it waits for. It
also runs the control plane actors register with (:mod:`learner.control`);
every ``publish_every`` steps, and whenever an actor needs weights at once
(a late joiner, or one beyond the staleness bound), all ranks publish the
policy to the actors (:mod:`learner.publisher`) at a step boundary. The
batch's frame is broadcast to the other ranks as raw bytes (no pickle) and
every rank decodes it, so all train on the same data. A batch the learner
refuses (no final reward, arrays that disagree) is counted and skipped before
any update. The version increments once per step; checkpoints every
``checkpoint_every`` steps and at the end (or on SIGTERM), then the HF export.

Versions only go up within a run, across learner restarts: a version names
one set of weights. A learner resumed from a checkpoint older than the last
publication (actors hold newer weights, the replay has seen newer versions)
labels its weights above every version announced or reported before
(:func:`learner.peers.starting_version`), so the actors take its first publication as new.

Rank 0's client of the replay (:mod:`learner.replay_client`) carries a
request across a replay restart or a dropped connection, and gives up when
the replay stays out of reach for ``learner.replay_timeout_s``.

Started as ``torchrun ... -m learner --settings FILE`` (``compactionrl
learner`` writes FILE: this package cannot read the run's TOML itself).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from learner.batch import BatchError, TrainBatch, to_train_batch
from learner.checkpoint import (
    CheckpointWriter,
    background_saves_here,
    export_hf,
    load_checkpoint,
    select_checkpoint,
    set_aside_later,
)
from learner.collectives import RankCollectives
from learner.metrics import LearnerMetrics
from learner.models import Sharding, load_critic, load_policy
from learner.peers import Peers, RankZeroPeers
from learner.ppo import PPOTrainer
from learner.publisher import WeightPublisher
from learner.samples import SAMPLES_FOLDER, SampleRecorder
from learner.settings import LearnerSettings
from learner.tracking.base import (
    SAMPLE_COLUMNS,
    Trackers,
    git_revision,
    open_tracker,
    rollout_samples,
    step_scalars,
)
from ops.metrics import Health, MetricsServer, watch_disk
from ops.timeline import close_timeline, open_timeline, span
from protocol import (
    Batch,
    ProtocolError,
    decode,
)

log = logging.getLogger("compactionrl.learner")

#: Name of the announced-version record in the checkpoints folder.
ANNOUNCED_RECORD = "announced.json"


class Learner:
    def __init__(self, settings: LearnerSettings, device: torch.device | None = None) -> None:
        self.settings = settings
        self.device = device or torch.device("cpu")
        self.config = settings.learner
        self.rank = dist.get_rank()
        self.collectives = RankCollectives(self.device)
        self.run_dir = Path(settings.run_dir)
        self.stopping = False
        self.version = 0
        self.step = 0
        self.metrics = LearnerMetrics()
        self.samples = SampleRecorder(self.run_dir / SAMPLES_FOLDER)
        # a checkpoint or export may hold the loop as long as an export may take
        self.health = Health("loading the model", liveness_s=self.config.export_timeout_s)
        self.tracker: Trackers | None = None
        """Rank 0's experiment tracking (None elsewhere, and when off)."""
        self._tokenizer: Any = None
        """Rank 0's readiness (resumed and joined to the replay) and liveness
        (its step loop: a step, a batch wait, a publication all beat)."""
        self.bf16 = self.device.type == "cuda" and self.config.mixed_precision == "bf16"
        # the dtype the models compute in, and so the exports'; their
        # parameters (the master weights) stay float32
        self.export_dtype = torch.bfloat16 if self.bf16 else torch.float32

    def _on_signal(self, *_: object) -> None:
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        checkpoints = self._load_and_resume()
        peers: Peers = (RankZeroPeers(self.settings, self.metrics,
                                        checkpoints / ANNOUNCED_RECORD)
                         if self.rank == 0 else Peers())
        # rank 0 serves the metrics; the first rank of every other node serves
        # its health alone (an empty registry), so each node's pod has probes
        first_on_node = os.environ.get("LOCAL_RANK", "0") == "0"
        server = MetricsServer(self.metrics.registry if self.rank == 0 else CollectorRegistry(),
                               self.config.metrics_port if first_on_node else 0,
                               self.settings.transport.metrics_address, self.health)
        if self.rank == 0:
            open_timeline(self.run_dir, "learner")  # rank 0's steps, waits and publications
            watch_disk(self.metrics.disk_free, self.metrics.disk_size, self.run_dir)
            self.tracker = open_tracker(self.settings.tracking, self.run_dir,
                                        self.settings.run_id)
        if self.tracker is not None:
            self.tracker.config(msgspec.to_builtins(self.settings),
                                git_revision(Path(__file__).parent))
        try:
            self.health.waiting_for = "joining the replay"
            batch_size = self.collectives.broadcast_int(peers.join())
            publisher = WeightPublisher(self.trainer.policy, self.config, self.settings.transport,
                                        self.rank, peers.control, self.metrics,
                                        self.collectives.broadcast_int, lambda: self.stopping)
            restored = self.version
            self.version = self.collectives.broadcast_int(peers.starting_version(restored))
            if self.version != restored and self.rank == 0:
                log.info("weights of version %d labelled version %d: an earlier learner of "
                         "this run got to version %d", restored, self.version,
                         self.version - 1)
            self.metrics.resumed(self.version, self.step)
            self.health.ready()
            if self.step < self.config.max_steps:
                # before any publication: the replay refuses tokens of a
                # version newer than the learner has asked with
                peers.request(batch_size, self.version)
            self._steps(peers, publisher, batch_size)
            self._checkpoint(final=True)
            export_hf(self.trainer.policy, self.settings.model, self.run_dir / "export",
                      self.export_dtype, self.config.export_timeout_s,
                      self.settings.trust_remote_code)
            if self.rank == 0:
                log.info("stopped cleanly (%s) at step %d, version %d: checkpoint and export "
                         "written", "signal" if self.stopping else "max_steps", self.step,
                         self.version)
        finally:
            peers.close()
            if self.tracker is not None:
                self.tracker.close()
            server.close()
            close_timeline()
        return 0

    def _load_and_resume(self) -> Path:
        """Load the policy and its critic, sharded, and resume from the
        checkpoint the settings name, if any; returns the checkpoint folder."""
        torch.manual_seed(0)
        sharding = Sharding(self.device, self.bf16, self.config.activation_checkpointing)
        value_head = self.config.critic == "value_head"
        remote = self.settings.trust_remote_code
        policy = load_policy(self.settings.model, sharding=sharding, value_head=value_head,
                             trust_remote_code=remote)
        critic = None if value_head else load_critic(self.settings.model, sharding=sharding,
                                                     trust_remote_code=remote)
        self.trainer = PPOTrainer(policy, critic, self.config)
        checkpoints = self.run_dir / "checkpoints"
        self.checkpoints = CheckpointWriter(
            checkpoints, background_saves_here(self.config.async_checkpoint, self.device.type,
                                               self.trainer),
            self.config.keep_last, self.config.keep_every)
        chosen = (select_checkpoint(checkpoints, self.settings.resume)
                  if self.settings.resume else None)
        if chosen is not None:
            self.version, self.step = load_checkpoint(chosen, self.trainer)
            log.info("resumed from %s at version %d", chosen, self.version)
            if self.rank == 0 and (aside := set_aside_later(checkpoints, chosen)) is not None:
                log.info("later checkpoints of the abandoned branch moved to %s", aside)
        return checkpoints

    def _steps(self, peers: Peers, publisher: WeightPublisher, batch_size: int) -> None:
        """Train until max_steps or a stop: publish when an actor needs
        weights or every publish_every steps, checkpoint every
        checkpoint_every steps."""
        while self.step < self.config.max_steps:
            self.health.beat()
            stopping, publish_now = self.collectives.true_on_any_rank(self.stopping,
                                                peers.weights_wanted(self.version))
            if stopping:
                break
            if publish_now:
                self._publish(publisher)
            with span("waiting for a batch", lane="learner"):
                taken = peers.next_batch(batch_size, self.version, self._should_stop_waiting)
                frame = self.collectives.broadcast_bytes(b"" if taken is None else taken.frame)
            if not frame:
                continue  # stopping, or weights are wanted first
            with span("step", lane="learner", step=self.step + 1):
                if not self._train(frame, None if taken is None else taken.batch):
                    continue
            # ask now: the replay learns the new version before any actor
            # can sample with it, assembles while we publish, and releases
            # the batch just trained in its log (after the last step: a
            # request for none, for that release alone)
            peers.request(batch_size if self.step < self.config.max_steps else 0,
                          self.version)
            if (self.step % self.config.checkpoint_every == 0
                    and self.step < self.config.max_steps):
                # after the request: a checkpoint never holds a batch the replay
                # would serve again to a learner resumed from it
                with span("checkpoint", lane="learner", step=self.step):
                    self._checkpoint()
            if (self.step % self.config.publish_every == 0
                    and self.step > self.config.critic_warmup_steps):  # a version to publish
                self._publish(publisher)

    def _publish(self, publisher: WeightPublisher) -> None:
        with span("publication", lane="learner", version=self.version):
            publisher.publish(self.version)

    def _should_stop_waiting(self) -> bool:
        """Asked over and over while a batch is awaited: the loop is alive;
        True once it should stop waiting."""
        self.health.beat()
        return self.stopping

    def _checkpoint(self, final: bool = False) -> None:
        """Save (in the background unless ``final``), export where
        ``export_every`` says; retention follows each completed save."""
        self.checkpoints.save(self.trainer, self.version, self.step)
        if final:
            self.checkpoints.close()
        if self.checkpoints.removed:
            log.info("retention removed %s", ", ".join(p.name for p in self.checkpoints.removed))
        if self.config.export_every and self.step % self.config.export_every == 0:
            export_hf(self.trainer.policy, self.settings.model,
                      self.run_dir / "exports" / f"step-{self.step}", self.export_dtype,
                      self.config.export_timeout_s, self.settings.trust_remote_code)

    def _train(self, frame: bytes, decoded: Batch | None) -> bool:
        """One step on the batch in ``frame`` (``decoded``: rank 0's, read
        once); False if it was refused."""
        began = time.perf_counter()
        try:
            message = (decoded if decoded is not None
                       else decode(frame, self.settings.transport.max_message_bytes))
            if not isinstance(message, Batch):
                raise BatchError(f"expected a Batch, got {type(message).__name__}")
            batch = to_train_batch(message, self.config.train_summary,
                                   self.config.share_prefixes)
        except (ProtocolError, BatchError) as exc:
            self.metrics.rejected_batches.inc()
            if self.rank == 0:
                log.warning("refused a batch: %s", exc)
            return False
        # the critic's warm-up: value-only steps; the policy, so its version, stays
        warming = self.step < self.config.critic_warmup_steps
        sample = (functools.partial(self.samples.record, self.step + 1, self.version)
                  if self.rank == 0 and self.samples.wants(self.step + 1)
                  else None)
        metrics = self.trainer.step(batch, value_only=warming, sample=sample,
                                    sampled_rollouts=self.samples.rollouts)
        self.version += 0 if warming else 1
        self.step += 1
        self.metrics.record(metrics, batch.rewards.tolist(), batch.successes,
                            batch.compactions, time.perf_counter() - began, self.version,
                            self.step, batch.tags, batch.grouped_rollouts())
        if self.tracker is not None:
            self._track(message, batch, metrics)
        if self.rank == 0:
            log.info("step %d: version %d, reward %.3f, %d tokens, policy loss %.4f",
                     self.step, self.version, float(batch.rewards.mean()), metrics["tokens"],
                     metrics.get("losses/policy_loss", 0.0))
        return True

    def _track(self, message: Batch, batch: TrainBatch, metrics: dict[str, float]) -> None:
        tracking = self.settings.tracking
        self.tracker.scalars(self.step, step_scalars(metrics, message, batch.rewards.tolist(),
                                                     batch.successes, batch.compactions))
        if self.step % tracking.samples_every == 0:
            if self._tokenizer is None:
                from transformers import AutoTokenizer
                self._tokenizer = AutoTokenizer.from_pretrained(
                    self.settings.model, trust_remote_code=self.settings.trust_remote_code)
            self.tracker.table(self.step, "rollouts/samples", SAMPLE_COLUMNS,
                               rollout_samples(message, self._tokenizer, tracking.samples))

