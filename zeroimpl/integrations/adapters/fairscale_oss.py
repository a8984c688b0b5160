"""FairScale OSS (sharded optimizer state) + ShardedDataParallel (gradients reduced to their owner): stage 2."""

from __future__ import annotations

import torch

from ..models import param_groups
from .base import OneOptimizerClass, TrainSettings
from .loop import WrapperLoopRunner, optimizer_state_tensors


class FairScaleRunner(WrapperLoopRunner):
    def zero_grad(self) -> None:
        self.module.zero_grad()  # ShardedDataParallel's own, as FairScale documents (keeps its bucket views)

    def clip(self, max_norm: float) -> None:
        self.optimizer.clip_grad_norm(max_norm)  # global norm over the shards (one all-reduce)

    def model_state(self) -> dict[str, list[torch.Tensor]]:
        state = self.common_state()
        state["optimizer_state"] = optimizer_state_tensors(self.optimizer.optim)
        param_buckets = [b for per_rank in self.optimizer.buckets.values() for b in per_rank.values()]
        buckets = param_buckets + self.module._bucket_list  # gradient buckets: a private list in 0.4.13
        state["buffers"] += [b.buffer for b in buckets if b.buffer is not None]
        return state


class FairScale(OneOptimizerClass):
    name = "FairScale OSS+SDP"
    stage = 2
    modules = ("fairscale",)
    install_hint = "pip install --no-build-isolation fairscale==0.4.13"

    def build(self, model, settings: TrainSettings, device) -> FairScaleRunner:
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS

        optimizer = OSS(param_groups(model, settings.weight_decay), optim=settings.adamw_class(),
                        **settings.adamw_kwargs())
        return FairScaleRunner(ShardedDataParallel(model, optimizer), model, optimizer, settings, device)
