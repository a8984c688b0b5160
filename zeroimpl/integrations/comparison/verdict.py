"""Correctness of each implementation against the reference (DDP + the same torch optimizers) run on the same
workload.

Tolerances follow zeroimpl's core parity tests (tests/test_optimizer_parity.py), in fp32: losses within ``LOSS_ATOL``
and parameters within ``PARAMETER_RTOL_OF_LR`` times the learning rate, i.e. 1% of one AdamW step (Adam
divides by sqrt(v), so a last-bit difference in a near-zero gradient can move that element by up to lr;
the core tests use 1e-4 at lr 1e-2). With Muon (tests/test_optimizer_kinds_whole_parameter.py): torch.optim.Muon
orthogonalises in bfloat16, so a last-bit gradient difference (another summation order, the clipping
norm) becomes a bf16 rounding of a whole update, and every parameter drifts through the forward pass:
parameters within ``MUON_PARAMETER_RTOL_OF_LR`` times Muon's learning rate and losses within
``MUON_LOSS_ATOL``. In bf16 (each implementation's own recipe against DDP under autocast) the parameters
themselves are rounded to bf16, whose spacing is 2^-7 at 1.0 (the norm layers' scales): parameters within
``BF16_PARAMETER_ATOL`` (two such steps) and losses within ``BF16_LOSS_ATOL`` (tests/test_precision_mixed.py's);
measured on GPT-2 small, 2 ranks, 6 steps at lr 1e-3: 8.7e-3 to 9.0e-3 and 2.8e-4 to 4.7e-4 for zeroimpl and
DeepSpeed. That rule cannot see a lost step at a small lr: bf16 rows judge the recipe, fp32 rows the
implementation. Every implementation is judged by the same rule; a NaN or Inf, a missing loss, a
parameter of another shape or ranks that end with different parameters is a deviation, never a pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .harness import RunResult

LOSS_ATOL = 1e-5
PARAMETER_RTOL_OF_LR = 1e-2
MUON_LOSS_ATOL = 1e-3
MUON_PARAMETER_RTOL_OF_LR = 0.25  # tiny LLaMA, 4 ranks, 5 steps: 0.19 lr measured
BF16_LOSS_ATOL = 5e-3
BF16_PARAMETER_ATOL = 2 ** -6


def tolerances(settings) -> tuple[float, float, str]:
    """(loss tolerance, parameter tolerance, how they were chosen) for a ``TrainSettings``."""
    if settings.precision == "bf16":
        return BF16_LOSS_ATOL, BF16_PARAMETER_ATOL, (f"loss {BF16_LOSS_ATOL:g}, parameters 2^-6: two bf16 steps at "
                                                     "1.0, as the parameters are stored in bf16")
    if settings.optimizer == "muon":
        return MUON_LOSS_ATOL, MUON_PARAMETER_RTOL_OF_LR * settings.muon_lr, (
            f"loss {MUON_LOSS_ATOL:g}, parameters {MUON_PARAMETER_RTOL_OF_LR * settings.muon_lr:g} = "
            f"{MUON_PARAMETER_RTOL_OF_LR:g} of Muon's lr: torch's Muon orthogonalises in bf16")
    return LOSS_ATOL, PARAMETER_RTOL_OF_LR * settings.lr, (
        f"loss {LOSS_ATOL:g}, parameters {PARAMETER_RTOL_OF_LR * settings.lr:g} = 1% of lr")


@dataclass(frozen=True)
class Verdict:
    implementation: str
    max_loss_deviation: float  # over every micro-batch of every rank (inf: missing, NaN or Inf values)
    max_parameter_deviation: float  # over every element of the final parameters (inf: likewise)
    loss_tolerance: float
    parameter_tolerance: float
    ranks_agree: bool  # every rank ended with the same parameters (checksums)
    is_reference: bool = False

    @property
    def bitwise(self) -> bool:
        return self.max_loss_deviation == 0 and self.max_parameter_deviation == 0

    @property
    def passed(self) -> bool:
        return (self.ranks_agree and math.isfinite(self.max_loss_deviation)
                and math.isfinite(self.max_parameter_deviation)
                and self.max_loss_deviation <= self.loss_tolerance
                and self.max_parameter_deviation <= self.parameter_tolerance)

    @property
    def status(self) -> str:
        if self.is_reference:
            return "reference"
        return "bitwise" if self.bitwise else "within tolerance" if self.passed else "DEVIATES"


def _largest(differences: torch.Tensor) -> float:
    """The largest absolute difference; inf if any value is NaN or Inf."""
    if differences.numel() == 0:
        return 0.0
    if not torch.isfinite(differences).all():
        return math.inf
    return differences.abs().max().item()


def _loss_deviation(run: RunResult, reference: RunResult) -> float:
    if len(run.ranks) != len(reference.ranks) or any(
            len(mine.losses) != len(theirs.losses) for mine, theirs in zip(run.ranks, reference.ranks)):
        return math.inf  # another number of micro-batches: not the same training
    mine = torch.tensor([loss for rank in run.ranks for loss in rank.losses], dtype=torch.float64)
    theirs = torch.tensor([loss for rank in reference.ranks for loss in rank.losses], dtype=torch.float64)
    return _largest(mine - theirs)


def _parameter_deviation(run: RunResult, reference: RunResult) -> float:
    mine = torch.load(run.parameters_path, weights_only=True)
    theirs = torch.load(reference.parameters_path, weights_only=True)
    if mine.keys() != theirs.keys():
        return math.inf
    largest = 0.0
    for name, expected in theirs.items():
        if mine[name].shape != expected.shape:
            return math.inf
        largest = max(largest, _largest(mine[name].double() - expected.double()))
    return largest


def judge(run: RunResult, reference: RunResult, settings) -> Optional[Verdict]:
    """Compare ``run`` with ``reference`` (both trained with ``settings``, a ``TrainSettings``); ``None`` if
    either did not finish."""
    if not (run.parameters_path and reference.parameters_path):
        return None
    ranks_agree = len({rank.parameter_checksum for rank in run.ranks}) == 1
    loss_tolerance, parameter_tolerance, _ = tolerances(settings)
    return Verdict(run.implementation, _loss_deviation(run, reference), _parameter_deviation(run, reference),
                   loss_tolerance, parameter_tolerance, ranks_agree, is_reference=run is reference)
