"""zeroimpl's ShardedOptimizer, stage 1 or 2, with or without CPU offload, on the bare model (no DDP)."""

from __future__ import annotations

import contextlib

import torch

from zeroimpl import ShardedOptimizer

from .base import Implementation, TrainSettings, training_groups
from .loop import WrapperLoopRunner


def sharded_groups(model: torch.nn.Module, settings: TrainSettings) -> list[dict]:
    """ShardedOptimizer's param groups: with "muon", the hidden matrices in a torch.optim.Muon group first."""
    matrices, groups = training_groups(model, settings)
    if matrices:
        return [{"params": matrices, "optimizer": torch.optim.Muon, **settings.muon_kwargs()}] + groups
    return groups


class ZeroimplRunner(WrapperLoopRunner):
    autocasts = False  # bf16: the model's parameters are bf16, the fp32 masters are the shard's

    def no_sync(self):
        # stage 1 reduces once per step anyway; with offload in stage 2 the sum stays on the device
        return self.optimizer.accumulating() if self.optimizer.offload else contextlib.nullcontext()

    def run_backward(self, loss: torch.Tensor) -> None:
        self.optimizer.backward(loss)

    def clip(self, max_norm: float) -> None:
        self.optimizer.clip_grad_norm_(max_norm)

    def model_state(self) -> dict[str, list[torch.Tensor]]:
        held, state = self.optimizer.held_tensors(), self.common_state()
        state["parameters"] = held["parameters"] + state["parameters"]  # frozen too
        # full gradients (stage 1's local ones, also those kept by the .grad views) and the shards
        state["gradients"] = held["gradients"] + held["gradient_shard"] + held["host_gradient_shard"]
        state["optimizer_state"] = held["optimizer_state"]
        state["master_weights"] = held["master_weights"]
        state["buffers"] += held["bucket_buffers"] + held["host_staging"]
        return state


class Zeroimpl(Implementation):
    modules = ()

    def __init__(self, stage: int, offload: bool = False):
        self.stage, self.offload = stage, offload
        self.name = f"zeroimpl stage {stage}" + (" + offload" if offload else "")

    def build(self, model, settings: TrainSettings, device) -> ZeroimplRunner:
        if settings.precision == "bf16":
            model.to(torch.bfloat16)
        optimizer = ShardedOptimizer(sharded_groups(model, settings), torch.optim.AdamW,
                                     stage=self.stage, offload="cpu" if self.offload else None,
                                     **settings.adamw_kwargs())
        return ZeroimplRunner(model, model, optimizer, settings, device)
