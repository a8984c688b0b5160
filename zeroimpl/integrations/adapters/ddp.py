"""The reference: DistributedDataParallel + torch.optim.AdamW (and torch.optim.Muon on the hidden matrices with
``optimizer="muon"``; bitsandbytes' AdamW8bit with ``"adamw8bit"``), every rank holding everything."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from .base import Implementation, TrainSettings, training_groups
from .loop import WrapperLoopRunner, optimizer_state_tensors


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """DDP with gradients as views of its buckets (no second copy of the gradients: DDP's leanest setting)."""
    device_ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)


class TorchOptimizers:
    """Several plain torch optimizers over disjoint parameters, stepped and cleared together."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self.optimizers for p, s in optimizer.state.items()}

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)


def torch_optimizers(model: torch.nn.Module, settings: TrainSettings) -> TorchOptimizers:
    """torch.optim.AdamW over the usual groups, and torch.optim.Muon over the hidden matrices with "muon"."""
    matrices, groups = training_groups(model, settings)
    optimizers = [settings.adamw_class()(groups, **settings.adamw_kwargs())]
    if matrices:
        optimizers.insert(0, torch.optim.Muon(matrices, **settings.muon_kwargs()))
    return TorchOptimizers(optimizers)


class DDPRunner(WrapperLoopRunner):
    def model_state(self) -> dict[str, list[torch.Tensor]]:
        state = self.common_state()
        state["optimizer_state"] = optimizer_state_tensors(self.optimizer)
        return state


class DDP(Implementation):
    name = "DDP"
    stage = 0

    def build(self, model, settings: TrainSettings, device) -> DDPRunner:
        return DDPRunner(wrap_ddp(model, device), model, torch_optimizers(model, settings), settings, device)
