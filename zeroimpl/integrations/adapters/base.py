"""The one interface every implementation in the comparison provides, so that the harness never special-cases one.

An :class:`Implementation` is a row of the comparison (e.g. "DeepSpeed ZeRO-2 + offload"): it says what it
needs installed and builds a :class:`Runner` around a freshly built model inside each rank. A runner trains
with the same optimizer settings as every other: AdamW with two param groups (decayed matrices, undecayed
biases and norms) -- or, with ``optimizer="muon"``, torch.optim.Muon on the hidden matrices and AdamW on the
rest; with ``"adamw8bit"``, bitsandbytes' AdamW8bit in place of AdamW -- gradient accumulation over the
micro-batches it is given, global-norm clipping.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from ..models import param_groups
from ..muon import split_hidden_matrices

MODEL_STATE_KINDS = ("parameters", "gradients", "optimizer_state", "master_weights", "buffers")


@dataclass(frozen=True)
class TrainSettings:
    """What every implementation trains with: the optimizer and its hyperparameters, accumulation and clipping."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    accum: int = 1  # micro-batches per optimizer step
    max_grad_norm: Optional[float] = 1.0  # global 2-norm clipping; None: no clipping
    micro_batch_size: int = 4
    optimizer: Literal["adamw", "muon", "adamw8bit"] = "adamw"  # muon: torch.optim.Muon on the hidden matrices
    muon_lr: float = 0.02
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: each implementation's own bf16 recipe. zeroimpl and DeepSpeed keep the parameters in bf16 and fp32
    master weights for their shard; DDP, PyTorch ZeRO and FairScale run the fp32 model under
    ``torch.autocast(dtype=torch.bfloat16)`` (automatic mixed precision)."""

    def adamw_class(self) -> type:
        """The AdamW every implementation runs: bitsandbytes' AdamW8bit with "adamw8bit", else torch's."""
        if self.optimizer == "adamw8bit":
            from bitsandbytes.optim import AdamW8bit

            return AdamW8bit
        return torch.optim.AdamW

    def adamw_kwargs(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}

    def muon_kwargs(self) -> dict:
        """torch.optim.Muon's hyperparameters (its other settings at torch's defaults)."""
        return {"lr": self.muon_lr, "weight_decay": self.weight_decay}


def training_groups(model: torch.nn.Module, settings: TrainSettings) -> tuple[list, list[dict]]:
    """(Muon's matrices, AdamW's param groups): with ``optimizer="adamw"`` no matrices and the usual two
    groups; with ``"muon"`` the hidden matrices (:func:`zeroimpl.integrations.muon.hidden_matrices`) and the
    two groups of everything else."""
    groups = param_groups(model, settings.weight_decay)
    if settings.optimizer != "muon":
        return [], groups
    return split_hidden_matrices(model, groups)


class Runner(ABC):
    """One implementation training one model on this rank.

    The harness calls, per optimizer step, :meth:`backward` with that step's micro-batches and then
    :meth:`step`; it reads :meth:`model_state` between the two and after the step.
    """

    @abstractmethod
    def backward(self, micro_batches: list[dict]) -> list[float]:
        """Clear the previous step's gradients; forward and backward every micro-batch (the loss of each
        divided by their number); return the unscaled loss of each micro-batch."""

    @abstractmethod
    def step(self) -> None:
        """Clip the averaged gradients to ``max_grad_norm`` (global norm) and take the optimizer step."""

    @abstractmethod
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model by name, full (unsharded), on this rank. May be a collective."""

    def settle(self) -> None:
        """Wait for the communication :meth:`step` left in flight (none by default; zeroimpl's overlapped
        parameter all-gathers): afterwards no byte of this step is still to cross the network."""

    def expose_collectives(self) -> None:
        """Make every collective go through ``torch.distributed``'s Python functions, where
        :class:`zeroimpl.integrations.collectives.CollectiveCounter` sees it (for communication counts only)."""

    @abstractmethod
    def model_state(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds for training, by kind (:data:`MODEL_STATE_KINDS`):

        * ``parameters`` -- the model's parameters (their flat buffers, where the implementation has them);
        * ``gradients`` -- gradients, full or sharded, wherever the implementation keeps them;
        * ``optimizer_state`` -- the optimizer's state tensors (moments, step counters);
        * ``master_weights`` -- fp32 copies of parameters the optimizer updates, when they are not the
          parameters themselves;
        * ``buffers`` -- the model's registered buffers and the implementation's communication buckets.

        A tensor may appear under several kinds or share storage with another: bytes are counted once per
        storage, for the first kind in that order that holds it.
        """


class Implementation(ABC):
    """A row of the comparison: a name, what must be installed, and how to build a runner."""

    name: str  # row label, unique
    stage: int  # 0 for unsharded data parallelism, else the ZeRO stage it matches
    offload: bool = False
    modules: tuple[str, ...] = ()  # importable modules it needs beyond torch
    install_hint: str = ""  # how to get them

    def unavailable(self) -> Optional[str]:
        """``None`` when it can run here, else why not and how to fix it (a peer that is not installed)."""
        missing = [m for m in self.modules if importlib.util.find_spec(m) is None]
        if missing:
            return f"{', '.join(missing)} not installed: {self.install_hint}"
        return None

    def unsupported(self, settings: TrainSettings) -> Optional[str]:
        """``None`` when it can train with ``settings``, else why not (an optimizer it cannot shard)."""
        return None

    def environment(self, device: str) -> dict[str, str]:
        """Environment variables each rank needs before importing the implementation (``device``: "cpu" or
        "cuda", where the run trains)."""
        return {}

    @abstractmethod
    def build(self, model: torch.nn.Module, settings: TrainSettings, device: torch.device) -> Runner:
        """Wrap ``model`` (already on ``device``, the same initial weights on every rank) for training."""


class OneOptimizerClass(Implementation):
    """An implementation that wraps one optimizer class over all parameters: it cannot run Muon on the hidden
    matrices beside AdamW."""

    def unsupported(self, settings: TrainSettings) -> Optional[str]:
        if settings.optimizer == "muon":
            return ("it wraps one optimizer class over all parameters, so it cannot run muon on the hidden matrices "
                    "beside AdamW")
        return None
