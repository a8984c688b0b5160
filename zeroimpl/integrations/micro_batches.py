"""The forward and backward passes of one optimizer step, shared by every training loop here: the comparison's
runners (:mod:`zeroimpl.integrations.adapters.loop`) and the tests' reference loop.

It imports torch alone, so that ranks which load it pull in nothing else (no peers, no
``torch.distributed.optim``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch


def run_micro_batches(forward: Callable, backward: Callable[[torch.Tensor], None], micro_batches: list[dict],
                      non_final: Callable[[], ContextManager]) -> list[float]:
    """Run each micro-batch's ``forward(**batch).loss`` and ``backward(loss / len(micro_batches))``, the
    non-final micro-batches inside ``non_final()`` (DDP's ``no_sync``, ``ShardedOptimizer.accumulating`` or
    ``contextlib.nullcontext``). Returns each micro-batch's loss, undivided, in order."""
    losses = []
    for index, batch in enumerate(micro_batches):
        final = index == len(micro_batches) - 1
        with contextlib.nullcontext() if final else non_final():
            loss = forward(**batch).loss
            backward(loss / len(micro_batches))
        losses.append(loss.item())
    return losses
