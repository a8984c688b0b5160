"""Rounds of gradient reduction: which buckets one backward pass launches, and when the pass has ended.

A *round* is what one backward pass reduces: each bucket once. It ends at the end of the outermost backward,
which an autograd-engine callback queued on the running backward reports. Reentrant activation checkpointing
runs a nested backward per segment: the end of a nested one leaves the round open (``RoundState.DEFERRED``)
so that the next segments fill the same buckets. A backward that failed part-way drops its callback (the
engine discards a failed backward's callbacks): its round is left open too, and whoever needs the gradients
next closes it; so does a close that raised (a bucket's buffer out of memory): it goes on from the first bucket it
did not launch, so that every rank still launches every bucket once per round, in order. Pure bookkeeping, no tensors and no collectives: :mod:`zeroimpl.grad_sync` acts on it.
"""

from __future__ import annotations

import enum
import sys
import weakref
from typing import Callable, Optional

import torch


class RoundState(enum.Enum):
    """Where the current round (one backward pass's reductions) stands."""

    IDLE = "idle"  # no gradient since the round was last closed
    RUNNING = "running"  # an end-of-backward callback is queued on a live backward
    DEFERRED = "deferred"  # a nested (reentrant) backward ended; the outer one may bring more gradients
    CLOSING = "closing"  # the outermost backward ended and the round is being closed (still so if closing raised)


class BackwardRound:
    """The state of the current round and the end-of-backward callback queued for it.

    Invariant: ``state is RUNNING`` exactly while a callback was queued and has not run; if its backward failed,
    the engine dropped the callback, which :meth:`interrupted` then tells, as it tells a close that raised.
    """

    def __init__(self) -> None:
        self.state = RoundState.IDLE
        self._callback: Optional[weakref.ref] = None

    @property
    def idle(self) -> bool:
        """No gradient has arrived since the round was last closed: the next one starts a round."""
        return self.state is RoundState.IDLE

    def interrupted(self) -> bool:
        """The backward the callback was queued on ended without calling it (it failed part-way), or the round's
        close raised: the round is open, and nothing will close it but its owner."""
        return self.state is RoundState.CLOSING or (self.state is RoundState.RUNNING and self._callback() is None)

    def follow(self, on_end: Callable[[], None]) -> None:
        """Queue ``on_end`` to run at the end of the backward now running, unless a callback already is."""
        if self.state is RoundState.RUNNING:
            return
        callback = _EndOfBackward(on_end)
        torch.autograd.Variable._execution_engine.queue_callback(callback)
        self._callback = weakref.ref(callback)  # dies with the backward if it fails
        self.state = RoundState.RUNNING

    def ended(self) -> bool:
        """The queued callback ran: whether the round closes now (the outermost backward ended) rather than
        staying open for the outer backward of a reentrant checkpoint."""
        self._callback = None
        if _inside_outer_backward():
            self.state = RoundState.DEFERRED
            return False
        self.state = RoundState.CLOSING
        return True

    def left_open(self) -> bool:
        """A round that no callback will close: deferred by a nested backward, or interrupted."""
        return self.state is RoundState.DEFERRED or self.interrupted()

    def reset(self) -> None:
        """The round closed."""
        self.state = RoundState.IDLE
        self._callback = None


class LaunchOrder:
    """Which buckets one round of backward launches, and when. Every rank must issue the same collectives in
    the same order whatever order its hooks fire in, so buckets launch strictly in index order: a bucket
    once every one of its parameters has a gradient and every bucket before it has launched, and the rest at
    the end of the round (a parameter without a gradient counts as zero). Buckets are offered (:meth:`arrive`,
    :meth:`through`, :meth:`remaining`) until their owner reports them :meth:`launched`."""

    def __init__(self, bucket_params: list[list[int]]):
        self._sizes = [len(params) for params in bucket_params]  # parameters per bucket
        self.reset()

    def reset(self) -> None:
        """A new round: nothing arrived, nothing launched."""
        self._arrived: list[set[int]] = [set() for _ in self._sizes]
        self._next = 0  # buckets below this index are launched

    def begun(self) -> bool:
        """Whether a gradient arrived or a bucket launched this round."""
        return self._next > 0 or any(self._arrived)

    def seen(self, bucket_index: int, param_index: int) -> bool:
        """Whether this parameter's gradient already arrived this round, or its bucket already launched."""
        return param_index in self._arrived[bucket_index] or bucket_index < self._next

    def arrived(self, bucket_index: int) -> set[int]:
        """The parameters of the bucket whose gradient arrived this round."""
        return self._arrived[bucket_index]

    def arrive(self, bucket_index: int, param_index: int) -> list[int]:
        """Record a gradient; return the buckets that may launch now, in order."""
        self._arrived[bucket_index].add(param_index)
        ready = self._next
        while ready < len(self._sizes) and len(self._arrived[ready]) == self._sizes[ready]:
            ready += 1
        return list(range(self._next, ready))

    def through(self, bucket_index: int) -> list[int]:
        """Every bucket up to ``bucket_index`` not launched yet, complete or not, in order."""
        return list(range(self._next, bucket_index + 1))

    def remaining(self) -> list[int]:
        """The end of the round: every bucket not launched yet, in order."""
        return self.through(len(self._sizes) - 1)

    def launched(self, bucket_index: int) -> None:
        """The next bucket's collective was issued."""
        assert bucket_index == self._next, (bucket_index, self._next)
        self._next += 1


def under_compiled_autograd() -> bool:
    """Whether compiled autograd is tracing this backward (its graph cannot hold collectives and callbacks).
    Reads torch's flag only when torch._dynamo has been imported."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return torch.compiler.is_compiling() or bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))


class _EndOfBackward:
    """The callback queued on a backward; the autograd engine drops it with a backward that fails."""

    def __init__(self, on_end: Callable[[], None]):
        self.on_end = on_end

    def __call__(self) -> None:
        self.on_end()


def _inside_outer_backward() -> bool:
    """Whether the backward now ending runs inside another one's node (reentrant checkpointing)."""
    current_node = getattr(torch._C, "_current_autograd_node", None)
    return current_node is not None and current_node() is not None
