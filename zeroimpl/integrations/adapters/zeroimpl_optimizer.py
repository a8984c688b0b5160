"""zeroimpl's ShardedOptimizer, stage 1 or 2, with or without CPU offload, flat or hybrid (a replicate x shard
device mesh), on the bare model (no DDP)."""

from __future__ import annotations

import contextlib
from typing import Optional, Union

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

    def settle(self) -> None:
        self.optimizer.finish_param_gathers()

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


def hybrid_mesh(replicas: int, device: torch.device):
    """A ``replicas x (world / replicas)`` device mesh (replicate x shard): shards within each group of
    consecutive ranks (a node, under torchrun), replicated across the groups."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % replicas:
        raise ValueError(f"a hybrid mesh of {replicas} replicas needs a world size divisible by it, got {world}")
    return init_device_mesh(device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))


class Zeroimpl(Implementation):
    modules = ()

    def __init__(self, stage: int, offload: bool = False, replicas: Optional[int] = None,
                 quantize: Union[bool, str] = False):
        """``replicas``: hybrid sharding over that many replicas of the shards (None: flat, one shard group);
        ``quantize``: the parameter all-gather and the gradient reduce-scatter in 8 bits (``quantize_param_gather``,
        ``quantize_grad_reduce``); ``"replicas"``: only the gradients' all-reduce across the replicas."""
        self.stage, self.offload, self.replicas, self.quantize = stage, offload, replicas, quantize
        self.name = (f"zeroimpl stage {stage}" + (" + offload" if offload else "")
                     + (f" hybrid ({replicas} replicas)" if replicas else "")
                     + {False: "", True: ", 8-bit collectives", "replicas": ", 8-bit across replicas"}[quantize])

    def build(self, model, settings: TrainSettings, device) -> ZeroimplRunner:
        if settings.precision == "bf16":
            model.to(torch.bfloat16)
        optimizer = ShardedOptimizer(sharded_groups(model, settings), settings.adamw_class(),
                                     stage=self.stage, offload="cpu" if self.offload else None,
                                     device_mesh=hybrid_mesh(self.replicas, device) if self.replicas else None,
                                     quantize_param_gather=self.quantize is True, quantize_grad_reduce=self.quantize,
                                     **settings.adamw_kwargs())
        return ZeroimplRunner(model, model, optimizer, settings, device)
