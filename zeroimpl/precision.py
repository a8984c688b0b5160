"""Precision: the dtype zeroimpl keeps and sums in (:func:`at_least_fp32`), and dynamic loss scaling for fp16 training
(fp16 parameters, or fp16 autocast over fp32 parameters): ``optimizer.backward(loss)`` multiplies the loss by the
current scale, so that fp16 gradients do not underflow, and the optimizer divides the fp32 gradient shard by it before
clipping and stepping. As in Megatron-LM, every overflowing step is skipped; the scale backs off after ``hysteresis``
overflows without a growth in between, and grows after ``growth_interval`` clean steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit and fp32 ``dtype``, fp64 for fp64: what the master weights, host gradient shards, gradient
    reductions and norms of parameters of ``dtype`` are kept and summed in."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class LossScaleConfig:
    """``ShardedOptimizer(loss_scale=...)``'s settings; invalid values raise ValueError."""

    initial_scale: float = 2.0 ** 16
    """The first step's scale."""
    growth_factor: float = 2.0
    """Multiplier after ``growth_interval`` clean steps."""
    backoff_factor: float = 0.5
    """Multiplier when the scale backs off."""
    growth_interval: int = 1000
    """Clean steps per growth."""
    hysteresis: int = 2
    """Overflows (each skipped) before the scale backs off; restored on growth."""
    min_scale: float = 1.0
    """The lowest scale."""

    def __post_init__(self):
        if not (self.initial_scale > 0 and self.min_scale > 0 and self.growth_factor >= 1
                and 0 < self.backoff_factor <= 1 and self.growth_interval >= 1 and self.hysteresis >= 1):
            raise ValueError(f"invalid LossScaleConfig {self}: need initial_scale > 0, min_scale > 0, "
                             "growth_factor >= 1, 0 < backoff_factor <= 1, growth_interval >= 1, "
                             "hysteresis >= 1")


class DynamicLossScaler:
    """The scale and its counters; ``update(found_overflow)`` is called once per optimizer step."""

    @classmethod
    def resolve(cls, loss_scale, params: list[torch.Tensor]) -> Optional["DynamicLossScaler"]:
        """The scaler for ShardedOptimizer's ``loss_scale`` option (``"auto"``: on when a parameter is fp16)."""
        if loss_scale == "auto":
            loss_scale = LossScaleConfig() if any(p.dtype == torch.float16 for p in params) else None
        return cls(loss_scale) if loss_scale else None

    def __init__(self, config: LossScaleConfig):
        self.config = config
        self.scale = float(config.initial_scale)
        self._clean_steps = 0  # consecutive steps without overflow since the last growth or overflow
        self._hysteresis_left = config.hysteresis
        self.skipped_steps = 0

    def update(self, found_overflow: bool) -> None:
        cfg = self.config
        if found_overflow:
            self.skipped_steps += 1
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
        else:
            self._clean_steps += 1
            if self._clean_steps >= cfg.growth_interval:  # (>=: a state counted under a longer interval)
                self._clean_steps = 0
                self._hysteresis_left = cfg.hysteresis
                self.scale *= cfg.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps,
                "hysteresis_left": self._hysteresis_left, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])
