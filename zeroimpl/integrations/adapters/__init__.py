"""One adapter per implementation compared, behind the interface of :mod:`zeroimpl.integrations.adapters.base`."""

from __future__ import annotations

from typing import Optional, Sequence

from .base import MODEL_STATE_KINDS, Implementation, Runner, TrainSettings
from .ddp import DDP
from .deepspeed_zero import DeepSpeed
from .fairscale_oss import FairScale
from .torch_zero import TorchZero
from .zeroimpl_optimizer import Zeroimpl


def all_implementations(only: Optional[Sequence[str]] = None) -> list[Implementation]:
    """Every row, in the order of the comparison table; DDP, the reference, first. ``only``: the rows whose name
    contains one of these (case-insensitive), and DDP, which every comparison is judged against."""
    rows = [DDP(), TorchZero(), FairScale(),
            DeepSpeed(1), DeepSpeed(2), DeepSpeed(1, offload=True), DeepSpeed(2, offload=True),
            Zeroimpl(1), Zeroimpl(2), Zeroimpl(1, offload=True), Zeroimpl(2, offload=True)]
    if only is None:
        return rows
    named = [row for row in rows if any(name.lower() in row.name.lower() for name in only)]
    if only and not named:
        raise ValueError(f"no implementation's name contains any of {list(only)}: the names are "
                         + ", ".join(repr(row.name) for row in rows))
    return [row for row in rows if row.stage == 0 or row in named]


__all__ = ["MODEL_STATE_KINDS", "DDP", "DeepSpeed", "FairScale", "Implementation", "Runner", "TorchZero",
           "TrainSettings", "Zeroimpl", "all_implementations"]
