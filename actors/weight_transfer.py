"""A vLLM weight-transfer engine of the project's own: publications from
learner rank 0 straight into the running engine's model, on the transport the
announcement names (a gloo or NCCL broadcast, or ipc staging buffers:
:mod:`protocol.weights`).

Registered through the ``vllm.general_plugins`` entry point (pyproject), so
vLLM's spawned worker processes know it; selected with
``weight_transfer_config={"backend": "compactionrl"}`` and driven through
``AsyncLLM``'s control plane: ``init_weight_transfer_engine`` (join a group
generation), then ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` per publication.

Weights arrive in checkpoint format, in the wire dtype the manifest names (the
engine's own, converted by the learner; :mod:`protocol.weights`), so the
conversion here is a no-op unless the learner could not tell the engine's
dtype. Every worker of a tensor-parallel engine joins the group with a rank of
its own (the announced base rank plus its rank within the engine) and receives
the full tensors; vLLM's loader takes each worker's shard. They are loaded
through vLLM's layerwise reload, which re-runs each layer's post-load
processing (the CPU build repacks linear weights). A broadcast that fails
part-way (a member died, a timeout) still finalises the reload, so the model
stays well-formed (old and new weights mixed) for the next full publication;
the caller must not generate with it until then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from protocol.messages import TensorSpec, WeightManifest
from protocol.transport import CurveConfig, TransportConfig
from protocol.weights import WeightChannel, connect_store, worker_rank
from protocol.weights_backends import join_channel
from protocol.weights_store import StoreClient

BACKEND = "compactionrl"

#: Tensors received ahead of the loader: the next ones travel while vLLM loads
#: and repacks this one (bench/weights.py: push/raw 2.65 -> 1.5-1.85 here).
RECEIVE_AHEAD = 4


@dataclass
class GroupInitInfo:
    """:class:`protocol.GroupInfo`, as vLLM passes it to the workers."""

    master_addr: str
    master_port: int
    world_size: int
    rank: int
    generation: int = 0
    backend: str = "gloo"
    timeout_s: float = 30.0
    curve: dict = field(default_factory=dict)
    """The actor's ``transport.curve`` (key file paths on this host): the
    rendezvous store answers only clients with an authorized key."""


@dataclass
class ManifestUpdateInfo:
    """:class:`protocol.WeightManifest`, flattened for vLLM's RPC."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    bucket_bytes: int = 0

    def manifest(self) -> WeightManifest:
        return WeightManifest(
            tensors=[TensorSpec(n, d, tuple(s)) for n, d, s in zip(
                self.names, self.dtypes, self.shapes, strict=True)],
            bucket_bytes=self.bucket_bytes)


def _repack_tied_lm_head(model: Any, model_config: Any) -> None:
    """With tied embeddings the CPU build keeps lm_head's own packed copy of
    the embedding, which vLLM's layerwise reload does not rebuild: redo it."""
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if method is not None and getattr(model_config.hf_config, "tie_word_embeddings", False):
        method.process_weights_after_loading(lm_head)


class GenerationMember:
    """The group generation an engine's worker joined last, and the store
    connection it joined through (its half of the transfer engine that
    needs no vLLM)."""

    group: WeightChannel | None = None
    store: StoreClient | None = None
    parallel_config: Any
    """vLLM's, set by the transfer engine's constructor."""

    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        self.leave()  # the previous generation first
        self.store = connect_store(init_info.master_addr, init_info.master_port,
                                   init_info.timeout_s,
                                   TransportConfig(curve=CurveConfig(**init_info.curve)))
        # every worker of a tensor-parallel engine holds a rank of its own
        rank = worker_rank(init_info.rank, self.parallel_config.rank)
        self.group = join_channel(self.store, init_info.generation, init_info.world_size,
                                  rank, init_info.backend, init_info.timeout_s)

    def leave(self) -> None:
        """Drop the generation joined last and close its store's connection:
        a failed NCCL generation's group is kept for the process's life
        (protocol/weights_collective.py ``retire``), and with it this store,
        which must not keep a socket each."""
        self.group = None
        if self.store is not None:
            self.store.close()
            self.store = None


def _engine_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    class BroadcastWeightTransferEngine(GenerationMember,
                                        WeightTransferEngine[GroupInitInfo, ManifestUpdateInfo]):
        init_info_cls = GroupInitInfo
        update_info_cls = ManifestUpdateInfo
        supports_draft_weight_update = False

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: ManifestUpdateInfo) -> None:
            manifest = update_info.manifest()
            dtype = self.model_config.dtype

            def converted():
                for name, tensor in self.group.receive(manifest, ahead=RECEIVE_AHEAD):
                    # the learner may train in another precision than this engine runs
                    yield name, tensor.to(self.device, dtype if tensor.is_floating_point()
                                          else tensor.dtype)

            self.model.load_weights(converted())

        def update_weights(self, update_info: dict) -> None:
            # The base class ends with torch.accelerator.synchronize(), which
            # raises on CPU-only torch; every bucket has been received here.
            try:
                self.receive_weights(self.parse_update_info(update_info))
            except BaseException:
                finalize_layerwise_reload(self.model, self.model_config)
                raise
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)
            _repack_tied_lm_head(self.model, self.model_config)

        def shutdown(self) -> None:
            self.leave()

    return BroadcastWeightTransferEngine


def register() -> None:
    """The ``vllm.general_plugins`` entry point: runs in every vLLM process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())
