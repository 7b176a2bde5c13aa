"""A vLLM weight-transfer engine of the project's own: gloo broadcasts from
learner rank 0 straight into the running engine's model.

Registered through the ``vllm.general_plugins`` entry point (pyproject), so
vLLM's spawned worker processes know it; selected with
``weight_transfer_config={"backend": "compactionrl-gloo"}``. Weights arrive in
checkpoint format and are loaded through vLLM's layerwise reload, which re-runs
each layer's post-load processing (the CPU build repacks linear weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BACKEND = "compactionrl-gloo"


@dataclass
class GlooInitInfo:
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    generation: int = 0


@dataclass
class GlooUpdateInfo:
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)


def _engine_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from protocol.weights import WeightGroup

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            self.group = WeightGroup(init_info.master_addr, init_info.master_port,
                                     init_info.generation, init_info.world_size, init_info.rank)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            def arriving():
                for name, dtype, shape in zip(update_info.names, update_info.dtypes,
                                              update_info.shapes, strict=True):
                    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                    self.group.broadcast(tensor)
                    yield name, tensor.to(self.device)

            self.model.load_weights(arriving())

        def update_weights(self, update_info: dict) -> None:
            # the base class ends with torch.accelerator.synchronize(), which
            # raises on CPU-only torch; gloo broadcasts have completed here
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            # With tied embeddings the CPU build keeps lm_head's own packed copy
            # of the embedding, which the reload does not rebuild: redo it.
            lm_head = getattr(self.model, "lm_head", None)
            method = getattr(lm_head, "quant_method", None)
            if method is not None and getattr(self.model_config.hf_config,
                                              "tie_word_embeddings", False):
                method.process_weights_after_loading(lm_head)

        def shutdown(self) -> None:
            self.group = None

    return GlooWeightTransferEngine


def register() -> None:
    """The ``vllm.general_plugins`` entry point: runs in every vLLM process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())
