"""Where the current optimizer step is, between two steps: one object instead of loose flags.

A step goes through these facts, each set once and all forgotten by :meth:`StepState.reset` (at the end of
``step()`` and at ``zero_grad()``):

* ``loss_scaled`` -- a loss was multiplied by the loss scale (``scale_loss`` / ``backward``). With loss
  scaling on, a gradient arriving without it is an error (the user called ``loss.backward()``).
* ``unscaled`` -- the gradient shards were divided by the loss scale (at the first
  :meth:`~zeroimpl.step_checks.StepChecks.prepare` after the last backward). With loss scaling on, a gradient
  arriving after it is an error.
* ``checked_in`` -- the step's gradients were finished with this rank checked in under torch's ``Join``
  (:mod:`zeroimpl.uneven`): a later ``prepare`` (the step after clipping) need not check in again until a new
  gradient arrives.
* ``verdict`` -- the step's agreement all-reduce ran (:class:`StepVerdict`). A new gradient arriving forgets
  it, so the checks run again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class StepVerdict:
    """The agreed outcome of a step's checks, identical on every rank."""

    same_passes: bool  # every rank ran the same number of backward passes since the last step
    nonfinite: bool  # the averaged gradients hold NaN or Inf
    stepped: Optional[list[bool]]  # per trainable parameter: a gradient on some rank; None: every parameter


class StepState:
    """The current step's progress; see the module docstring for the facts and when each is set."""

    def __init__(self, loss_scaling: bool):
        self.loss_scaling = loss_scaling
        self.reset()

    def reset(self) -> None:
        self.loss_scaled = False
        self.unscaled = False
        self.checked_in = False
        self.verdict: Optional[StepVerdict] = None

    def gradient_arrived(self) -> None:
        """A gradient reached the optimizer: forget the verdict; with loss scaling, refuse a gradient of an
        unscaled loss or one that comes after the shards were unscaled."""
        self.verdict = None
        self.checked_in = False
        if not self.loss_scaling:
            return
        if not self.loss_scaled:
            raise RuntimeError("loss scaling is on (fp16 parameters, or loss_scale=LossScaleConfig(...)), so the "
                               "loss must be scaled: call optimizer.backward(loss) instead of loss.backward()")
        if self.unscaled:
            raise RuntimeError("backward() between clip_grad_norm_() and step() is not supported with "
                               "loss scaling; run every backward of the step before clipping")
