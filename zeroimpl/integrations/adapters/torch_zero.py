"""PyTorch's ZeroRedundancyOptimizer (optimizer state sharded, stage 1) on a DDP-wrapped model."""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..models import param_groups
from .base import OneOptimizerClass, TrainSettings
from .ddp import wrap_ddp
from .loop import WrapperLoopRunner, optimizer_state_tensors


class TorchZeroRunner(WrapperLoopRunner):
    def model_state(self) -> dict[str, list[torch.Tensor]]:
        state = self.common_state()
        state["optimizer_state"] = optimizer_state_tensors(self.optimizer.optim)  # this rank's shard
        return state


class TorchZero(OneOptimizerClass):
    name = "PyTorch ZeRO"
    stage = 1

    def build(self, model, settings: TrainSettings, device) -> TorchZeroRunner:
        optimizer = ZeroRedundancyOptimizer(param_groups(model, settings.weight_decay), settings.adamw_class(),
                                            **settings.adamw_kwargs())
        return TorchZeroRunner(wrap_ddp(model, device), model, optimizer, settings, device)
