"""The training loop shared by every implementation that is a module wrapper plus a torch-style optimizer."""

from __future__ import annotations

import torch

from ...grad_views import ShardedGrad
from ..micro_batches import run_micro_batches
from .base import Runner, TrainSettings


def on_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


class WrapperLoopRunner(Runner):
    """Forward through ``module`` (a DDP-like wrapper of ``model``, or ``model`` itself), accumulate with
    :meth:`no_sync` on non-final micro-batches, clip with :meth:`clip`, step ``optimizer``.

    Subclasses override the hooks where their implementation differs; :meth:`model_state` lists what each
    holds.
    """

    autocasts = True  # with precision "bf16", forward under torch.autocast (False: the model itself is bf16)

    def __init__(self, module: torch.nn.Module, model: torch.nn.Module, optimizer, settings: TrainSettings,
                 device: torch.device):
        self.module = module  # what forward runs through
        self.model = model  # the Hugging Face model underneath
        self.optimizer = optimizer
        self.settings = settings
        self.device = device

    def expose_collectives(self) -> None:
        """DDP all-reduces its buckets from C++; its default comm hook does the same through ``dist.all_reduce``."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(self.module, DistributedDataParallel):
            self.module.register_comm_hook(None, allreduce_hook)

    def no_sync(self):
        """Context for non-final micro-batches: skip the gradient reduction."""
        return self.module.no_sync()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip(self, max_norm: float) -> None:
        """Clip by the global norm of the averaged gradients (every rank holds them all after DDP)."""
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def backward(self, micro_batches: list[dict]) -> list[float]:
        self.zero_grad()
        forward = self.module
        if self.autocasts and self.settings.precision == "bf16":
            forward = _under_autocast(self.module, self.device)
        return run_micro_batches(forward, self.run_backward,
                                 [on_device(batch, self.device) for batch in micro_batches], self.no_sync)

    def step(self) -> None:
        if self.settings.max_grad_norm is not None:
            self.clip(self.settings.max_grad_norm)
        self.optimizer.step()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return replicated_parameters(self.model)

    def common_state(self) -> dict[str, list[torch.Tensor]]:
        """Parameters, their ``.grad`` and the model's buffers: what every implementation holds. (zeroimpl's
        ``.grad`` after backward is a view of its gradient shard, which it counts itself: not a gradient here.)"""
        params = list(self.model.parameters())
        return {"parameters": params, "gradients": [p.grad for p in params if p.grad is not None
                                                    and not isinstance(p.grad, ShardedGrad)],
                "optimizer_state": [], "master_weights": [], "buffers": list(self.model.buffers())}


def replicated_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name, fp32 on the CPU, for implementations whose ranks all hold the full model."""
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _under_autocast(module: torch.nn.Module, device: torch.device):
    """``module``'s forward under ``torch.autocast`` to bfloat16 on ``device``."""
    def forward(**batch):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return module(**batch)
    return forward
