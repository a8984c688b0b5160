"""The reference: DistributedDataParallel + torch.optim.AdamW, every rank holding everything."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from ..models import param_groups
from .base import Implementation, TrainSettings
from .loop import WrapperLoopRunner, optimizer_state_tensors


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """DDP with gradients as views of its buckets (no second copy of the gradients: DDP's leanest setting)."""
    device_ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)


class DDPRunner(WrapperLoopRunner):
    def model_state(self) -> dict[str, list[torch.Tensor]]:
        state = self.common_state()
        state["optimizer_state"] = optimizer_state_tensors(self.optimizer)
        return state


class DDP(Implementation):
    name = "DDP"
    stage = 0

    def build(self, model, settings: TrainSettings, device) -> DDPRunner:
        optimizer = torch.optim.AdamW(param_groups(model, settings.weight_decay), **settings.adamw_kwargs())
        return DDPRunner(wrap_ddp(model, device), model, optimizer, settings, device)
