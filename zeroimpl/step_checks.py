"""From "backward ran" to "ready to step". :meth:`StepChecks.prepare` (called by the step and by the first operation on
a ``param.grad`` view) finishes the reduction (stage 1: the step's reduce-scatter) and the unscaling.
:meth:`StepChecks.agree` is the step's one host sync: an all-reduce of 5 values (:func:`encode_checks`) says whether any
shard holds NaN/Inf, whether every rank ran the same backward passes, the global norm when clipping, and whether some
rank lacks some gradient (only then does a second all-reduce say which).

The step's facts, each set once, all forgotten by :meth:`StepChecks.reset` (end of ``step()``, ``zero_grad()``):

* ``loss_scaled`` / ``unscaled`` -- a loss was scaled / the shards were unscaled. With loss scaling on, ``prepare``
  refuses a backward without the one or after the other, before any collective (a hook would raise midway).
* ``checked_in`` -- this rank checked in under torch's ``Join`` (:mod:`zeroimpl.uneven`); again after a backward.
* ``verdict`` -- the agreement (:class:`StepVerdict`), forgotten by a backward and by any edit of ``param.grad`` but a
  multiplication by at most 1 in magnitude (clipping keeps NaN/Inf as it was).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from .grad_shards import DeviceGradientShards, HostGradientShards
from .grad_sync import GradientReducer, RoundState
from .host_memory import device_tensor, to_device
from .ownership import Ownership
from .precision import DynamicLossScaler, at_least_fp32
from .topology import Topology


@dataclass(frozen=True)
class StepVerdict:
    """The agreed outcome of a step's checks, identical on every rank."""

    same_passes: bool  # every rank ran the same number of backward passes since the last step
    nonfinite: bool  # the averaged gradients hold NaN or Inf
    stepped: Optional[list[bool]]  # per trainable parameter: a gradient on some rank; None: every parameter


class StepChecks:
    def __init__(self, *, reducer: GradientReducer, ownership: Ownership, loss_scaler: Optional[DynamicLossScaler],
                 topology: Topology, device: torch.device):
        self.reducer = reducer
        self.gradients: Union[DeviceGradientShards, HostGradientShards] = reducer.gradients
        self.ownership, self.uneven, self.loss_scaler = ownership, reducer.uneven, loss_scaler
        self.topology, self.device = topology, device
        self.reset()

    def reset(self) -> None:
        self.loss_scaled = False
        self.unscaled = False
        self.checked_in = False
        self.verdict: Optional[StepVerdict] = None
        # per device: the largest |factor| since the verdict, taken at each multiply (a tensor may change later)
        self._largest: dict[torch.device, torch.Tensor] = {}
        self._prepared = False  # prepare() found gradients to step on (see ``prepared``)
        self._passes_seen = self.reducer.backward_passes  # at the last prepare: more since, a backward ran
        self._takes_seen = self.reducer.takes  # under DDP: param.grad copied afresh since, the facts are stale

    def note_edit(self, factor=None) -> None:
        """``param.grad`` was edited alike on every rank: times ``factor`` (number or 1-element tensor), else None."""
        if self.verdict is None:
            return
        if factor is None or not isinstance(factor, torch.Tensor) and not abs(factor) <= 1:  # (NaN compares false)
            self._forget_verdict()
        elif isinstance(factor, torch.Tensor):
            magnitude = factor.detach().abs().reshape(())  # (a NaN factor stays NaN, through the maximum too)
            largest = self._largest.get(magnitude.device)
            self._largest[magnitude.device] = magnitude if largest is None else torch.maximum(largest, magnitude)

    def verdict_stands(self) -> bool:
        """Whether the verdict holds: every :meth:`note_edit` factor since was finite and at most 1 in magnitude. Never
        under DDP: DDP's ``param.grad`` edited on some ranks only would leave it standing there alone."""
        if self.verdict is not None and (self.reducer.under_ddp
                                         or not all(bool(largest <= 1) for largest in self._largest.values())):
            self.verdict = None  # (NaN compares false)
        self._largest = {}
        return self.verdict is not None

    def _forget_verdict(self) -> None:
        self.verdict, self._largest = None, {}

    def note_loss_scaled(self) -> None:
        self.loss_scaled = True

    @property
    def prepared(self) -> bool:
        """:meth:`prepare` found gradients to step on, and no backward ran or runs since (nor, under DDP, did DDP
        write ``param.grad`` afresh): the shards hold this round's averaged, unscaled gradients."""
        return (self._prepared and self.reducer.state is RoundState.IDLE
                and self.reducer.backward_passes == self._passes_seen and self.reducer.takes == self._takes_seen)

    def prepare(self) -> bool:
        """Finish reduction and unscaling; whether there are gradients to step. Collective: same point on every rank."""
        self._prepared = False
        self.reducer.finish_grad_sync()  # before the check-in: the other ranks reduce-scattered it in their backward
        if self.reducer.backward_passes != self._passes_seen:  # a backward ran since the last prepare
            problem = loss_scaling_misuse(self.loss_scaled, self.unscaled) if self.loss_scaler is not None else None
            if problem is not None:
                raise RuntimeError(problem)
            self._forget_verdict()
            self.checked_in = False
            self._passes_seen = self.reducer.backward_passes
        if not self.checked_in:  # once per round of gradients, not again at the step after clipping
            self.uneven.check_in()
            self.checked_in = True
        self.ownership.check_unchanged(self.reducer.storages)
        if self.reducer.reduce_held_grads():  # stage 1: a param.grad set by hand since: the verdict did not see it
            self._forget_verdict()
        if self.reducer.takes != self._takes_seen:  # under DDP, DDP's param.grad taken afresh: check it afresh
            self._takes_seen, self.unscaled = self.reducer.takes, False
            self._forget_verdict()
        if not self.gradients.has_gradients and not any(self.reducer.grad_exists):
            return False  # (zero gradients kept by zero_grad(set_to_none=False) step, as in torch)
        if self.loss_scaler is not None and not self.unscaled:
            self.gradients.unscale(1.0 / self.loss_scaler.scale)  # (16-bit shards widened to fp32 first)
            self.unscaled = True
        self._prepared = True
        return True

    def shards(self) -> list[torch.Tensor]:
        """The gradient shards of the buckets that have one (on the host with offload)."""
        return [shard for shard in self.gradients.ready() if shard is not None]

    def scale_to_norm(self, max_norm: float, total: torch.Tensor) -> bool:
        """Scale the shards as torch's ``clip_grad_norm_`` does for the agreed ``total``; whether there were any."""
        shards = self.shards()
        if not shards:
            return False
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # offload on a GPU: this copy of one scalar to the host is the step's second sync (with clipping)
        torch._foreach_mul_(shards, coefficient.to(shards[0].device))
        return True

    def forget(self, param_indices: list[int]) -> None:
        """The user cleared these parameters' ``.grad``: forget their gradients and the verdict that counted them."""
        self.reducer.forget(param_indices)
        self._forget_verdict()

    def agree(self, norm_type: Optional[float] = None, riders: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The agreement all-reduce: sets ``verdict``; returns the global norm for ``norm_type`` on the device, else
        ``None``. ``riders`` (1-D fp64) ride along, reduced in place (sum; max for ``inf``), counted once under hybrid
        sharding. Only a non-finite norm (finite gradients can give one) makes every rank run :meth:`_any_nonfinite`."""
        shards = self.shards()
        passes = float(self.reducer.backward_passes)
        maximum = norm_type == float("inf")
        if maximum:
            norm_term = torch.stack([torch.linalg.vector_norm(s, norm_type, dtype=at_least_fp32(s.dtype))
                                     for s in shards] or [torch.zeros((), device=self.device)]).max()
        else:
            power = 2.0 if norm_type is None else norm_type
            norm_term = torch.stack([torch.linalg.vector_norm(s, power, dtype=at_least_fp32(s.dtype)) ** power
                                     for s in shards] or [torch.zeros((), device=self.device)]).sum()
            if self.topology.replicate_rank != 0:  # the replicas hold the same shards: count them once
                norm_term = torch.zeros_like(norm_term)
        values = to_device(encode_checks(norm_term, passes, not all(self.reducer.grad_exists), maximum), self.device)
        if riders is not None:
            counted = riders if maximum or self.topology.replicate_rank == 0 else torch.zeros_like(riders)
            values = torch.cat([values, to_device(counted, self.device)])
        agreed = self.topology.all_reduce_(values, dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM,
                                           "gradient check all-reduce", read_on_host=True)
        if riders is not None:
            riders.copy_(agreed[CHECK_VALUES:])
            agreed = agreed[:CHECK_VALUES]
        self._largest = {}
        suspect, same_passes, lacking = decode_checks(agreed.tolist(), maximum, self.topology.world_size)  # host sync
        if not same_passes and not self.reducer.under_ddp:  # (under DDP, DDP's rule: no_sync micro-batches may differ)
            self.verdict = StepVerdict(same_passes=False, nonfinite=False, stepped=None)
            return None
        self.verdict = StepVerdict(same_passes=True, nonfinite=suspect and self._any_nonfinite(shards),
                                   stepped=self._params_with_gradients() if lacking else None)
        if norm_type is None:
            return None
        if self.verdict.nonfinite and maximum:  # a MAX all-reduce need not carry a NaN through
            return torch.full((), float("nan"), device=self.device)
        norm = agreed[1].to(norm_term.dtype)
        return norm if maximum else norm ** (1.0 / norm_type)

    def _params_with_gradients(self) -> list[bool]:
        """By parameter index, whether any rank has its gradient: a flag per parameter, all-reduced."""
        local = device_tensor(self.reducer.grad_exists, self.device, torch.float32)
        agreed = self.topology.all_reduce_(local, dist.ReduceOp.MAX, "gradient presence all-reduce", read_on_host=True)
        return [flag > 0 for flag in agreed.tolist()]

    def _any_nonfinite(self, shards: list[torch.Tensor]) -> bool:
        """Whether any rank's shard holds NaN/Inf, exactly: a mask per shard, one more all-reduce and host sync."""
        local = torch.stack([~torch.isfinite(s).all() for s in shards]).any().float().reshape(1)
        local = to_device(local, self.device)
        agreed = self.topology.all_reduce_(local, dist.ReduceOp.MAX, "gradient NaN/Inf all-reduce", read_on_host=True)
        return bool(agreed.item())


def loss_scaling_misuse(loss_scaled: bool, unscaled: bool) -> Optional[str]:
    """With loss scaling on, what is wrong with a backward that ran since the last ``prepare``, or None."""
    if not loss_scaled:
        return ("loss scaling is on (fp16 parameters, or loss_scale=LossScaleConfig(...)), so the loss must be "
                "scaled: call optimizer.backward(loss) instead of loss.backward()")
    if unscaled:
        return ("backward() between clip_grad_norm_() and step() is not supported with loss scaling; run every "
                "backward of the step before clipping")
    return None


def nonfinite_message(loss_scale: Optional[float]) -> str:
    """Why ``step()`` raises ``FloatingPointError`` (``loss_scale``: the scale, at its minimum, or ``None``)."""
    at_minimum = f" even at the minimum loss scale {loss_scale}" if loss_scale is not None else ""
    return (f"the averaged gradients hold NaN or Inf{at_minimum}: this step was not applied and its gradients were "
            "cleared (parameters and optimizer state are unchanged, on every rank). Usual causes: a learning rate "
            "too high, a diverging loss, bad input data, or fp16 without loss scaling. Fix the cause (lower the "
            "learning rate, clip gradients, use bf16), or pass nonfinite='skip' to skip such steps and count them "
            "in optimizer.skipped_steps")


def passes_message(passes: int) -> str:
    """Why ``step()`` raises when the ranks ran different numbers of backward passes (``passes``: this rank's)."""
    return (f"the ranks ran different numbers of backward passes before step() (this rank: {passes}); every rank "
            "must run the same micro-batches per optimizer step. The gradients were cleared; nothing was updated")


CHECK_VALUES = 5  # the length of encode_checks' values


def encode_checks(norm_term: torch.Tensor, passes: float, lacking: bool, maximum: bool) -> torch.Tensor:
    """This rank's ``[NaN/Inf suspected, norm term, pass term, pass term, lacking]`` for a SUM all-reduce (norm term
    ``sum |g|**p``) or a MAX one (``maximum``: inf-norm). fp64: sums of squared pass counts stay exact to 2**53 (in
    fp32, 1024 ranks of 129 passes already round), and two fp32 norm terms summed in fp64 round to fp32's own sum."""
    counts = [passes, -passes] if maximum else [passes, passes * passes]
    suspect = (~torch.isfinite(norm_term)).double().reshape(1)
    tail = device_tensor(counts + [1.0 if lacking else 0.0], norm_term.device, torch.float64)
    return torch.cat([suspect, norm_term.double().reshape(1), tail])


def decode_checks(reduced: list[float], maximum: bool, world_size: int) -> tuple[bool, bool, bool]:
    """``(NaN/Inf suspected, same backward passes everywhere, some rank lacks a gradient)``. Pass counts ``c`` agree iff
    ``N * sum(c**2) == sum(c)**2`` (SUM; Cauchy-Schwarz) or ``max(c) == -max(-c)`` (MAX)."""
    suspect, _, first, second, lacking = reduced
    same_passes = first == -second if maximum else world_size * second == first ** 2
    return suspect > 0, same_passes, lacking > 0
