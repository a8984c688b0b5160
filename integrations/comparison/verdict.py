"""Correctness of each implementation against the reference (DDP + torch AdamW) run on the same workload.

Tolerances are zeroimpl's core-test ones (tests/test_parity.py), in fp32: losses within ``LOSS_ATOL`` and
parameters within ``PARAMETER_ATOL`` (1% of one AdamW step at lr 1e-2: Adam divides by sqrt(v), so a
last-bit difference in a near-zero gradient can move that element by up to lr). Every implementation is
judged against the same tolerance; one that deviates is reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .harness import RunResult

LOSS_ATOL = 1e-5
PARAMETER_ATOL = 1e-4


@dataclass(frozen=True)
class Verdict:
    implementation: str
    max_loss_deviation: float  # over every micro-batch of every rank
    max_parameter_deviation: float  # over every element of the final parameters
    loss_tolerance: float = LOSS_ATOL
    parameter_tolerance: float = PARAMETER_ATOL

    @property
    def bitwise(self) -> bool:
        return self.max_loss_deviation == 0 and self.max_parameter_deviation == 0

    @property
    def passed(self) -> bool:
        return (self.max_loss_deviation <= self.loss_tolerance
                and self.max_parameter_deviation <= self.parameter_tolerance)

    @property
    def status(self) -> str:
        return "bitwise" if self.bitwise else "within tolerance" if self.passed else "DEVIATES"


def judge(run: RunResult, reference: RunResult) -> Optional[Verdict]:
    """Compare ``run`` with ``reference``; ``None`` if either did not run to the end."""
    if not (run.parameters_path and reference.parameters_path):
        return None
    loss_deviation = max(abs(a - b) for mine, theirs in zip(run.ranks, reference.ranks)
                         for a, b in zip(mine.losses, theirs.losses))
    mine = torch.load(run.parameters_path, weights_only=True)
    theirs = torch.load(reference.parameters_path, weights_only=True)
    if mine.keys() != theirs.keys():
        raise ValueError(f"{run.implementation} returned other parameter names than {reference.implementation}")
    parameter_deviation = max((mine[name] - theirs[name]).abs().max().item() for name in theirs)
    return Verdict(run.implementation, loss_deviation, parameter_deviation)
