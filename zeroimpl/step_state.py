"""Where the current optimizer step is, between two steps: one object instead of loose flags.

A step goes through these facts, each set once and all forgotten by :meth:`StepState.reset` (at the end of
``step()`` and at ``zero_grad()``):

* ``loss_scaled`` -- a loss was multiplied by the loss scale (``scale_loss`` / ``backward``). With loss
  scaling on, a gradient arriving without it is an error (the user called ``loss.backward()``).
* ``unscaled`` -- the gradient shards were divided by the loss scale (at ``clip_grad_norm_``,
  ``found_nonfinite`` or ``step``). With loss scaling on, a gradient arriving after it is an error.
* ``verdict`` -- the step's agreement all-reduce ran: whether the averaged gradients hold NaN/Inf, and which
  parameters have a gradient on some rank (``None``: all of them). A new gradient arriving forgets it, so
  the checks run again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .host_memory import device_tensor


@dataclass(frozen=True)
class StepVerdict:
    """The agreed outcome of a step's checks, identical on every rank."""

    nonfinite: bool  # the averaged gradients hold NaN or Inf
    stepped: Optional[list[bool]]  # per trainable parameter: a gradient on some rank; None: every parameter


class StepState:
    """The current step's progress; see the module docstring for the facts and when each is set."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.loss_scaled = False
        self.unscaled = False
        self.verdict: Optional[StepVerdict] = None

    def gradient_arrived(self, loss_scaling: bool) -> None:
        """A gradient reached the optimizer: forget the verdict; with loss scaling, refuse a gradient of an
        unscaled loss or one that comes after the shards were unscaled."""
        self.verdict = None
        if not loss_scaling:
            return
        if not self.loss_scaled:
            raise RuntimeError("loss scaling is on (fp16 parameters, or loss_scale=LossScaleConfig(...)), so the "
                               "loss must be scaled: call optimizer.backward(loss) instead of loss.backward()")
        if self.unscaled:
            raise RuntimeError("backward() between clip_grad_norm_() and step() is not supported with "
                               "loss scaling; run every backward of the step before clipping")


def encode_checks(norm_term: torch.Tensor, passes: float, lacking: bool, maximum: bool) -> torch.Tensor:
    """This rank's five values for the step's one check all-reduce: ``[NaN/Inf suspected, norm term, pass
    count term, pass count term, lacking]``, for a SUM all-reduce (2- or p-norm: the norm term is
    ``sum |g|**p``) or a MAX one (``maximum``, inf-norm). ``passes``: this rank's backward passes since the
    last step; ``lacking``: some parameter of this rank has no gradient. On ``norm_term``'s device, in its
    dtype (fp32, or fp64 for fp64 gradients)."""
    counts = [passes, -passes] if maximum else [passes, passes * passes]
    suspect = (~torch.isfinite(norm_term)).float().reshape(1)
    tail = device_tensor(counts + [1.0 if lacking else 0.0], norm_term.device, torch.float32)
    return torch.cat([suspect, norm_term.reshape(1), tail])


def decode_checks(reduced: list[float], maximum: bool, world_size: int) -> tuple[bool, bool, bool]:
    """The agreed ``(NaN/Inf suspected on some rank, every rank ran the same backward passes, some rank
    lacks a gradient)`` from the reduced values of :func:`encode_checks`, identical on every rank.

    Pass counts ``c`` agree iff ``N * sum(c**2) == sum(c)**2`` (SUM; equality in Cauchy-Schwarz) or
    ``max(c) == -max(-c)`` (MAX). A suspected NaN/Inf is only suspected: a finite gradient's norm term can
    overflow fp32, which the caller tells apart."""
    suspect, _, first, second, lacking = reduced
    same_passes = first == -second if maximum else world_size * second == first ** 2
    return suspect > 0, same_passes, lacking > 0
