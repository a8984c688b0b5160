"""One component's GPU work, issued from several CUDA streams, run in the order the host issued it. Autograd runs a
parameter's post-accumulate-grad hook on the stream the forward used it on, so with a forward branch on a side stream
the gradient reducer writes one bucket buffer from several streams, and launches and finishes its reduce-scatter on
others. Unordered, a launch could read a slot before another stream's write, a finish a buffer before its writes (at
world size 1 no collective orders anything), two streams could add into one gradient shard at once.

:class:`WorkStream` runs the work as spans (:meth:`WorkStream.span`): on the one stream they all came from so far, and
once one comes from another stream, on ``own`` (from torch's pool: maybe a stream the program uses too, which then also
waits where ``own`` does). A hook's span is not joined, so that in backward no compute stream waits on the GPU for
another's queue or the communication. The caching allocator reuses a freed block after its allocation stream's work
only: a tensor used on another stream is recorded there (``use``, ``hand_over``). On CPU nothing happens."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch


class WorkStream:
    """Where one component's GPU work runs (see the module docstring)."""

    def __init__(self, device: Union[torch.device, str]):
        self.device = torch.device(device)
        self.first: Optional[torch.cuda.Stream] = None  # the stream every span came from so far (None: none yet, CPU)
        self.own: Optional[torch.cuda.Stream] = None  # its own stream, once a span came from another
        self._caller: Optional[torch.cuda.Stream] = None  # the stream the current span came from
        self.depth = 0  # spans open now (on CPU too): work that needs one can tell it runs inside one

    @contextmanager
    def span(self, joined: bool = True) -> Iterator[None]:
        """Run the body's GPU work after what the current stream has queued and after every earlier span;
        ``joined``: the current stream's later work waits for it too."""
        self.depth += 1
        try:
            caller = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            if self.own is None and caller is not None:
                if self.first is None:
                    self.first = caller
                if caller != self.first:  # the first span from a second stream
                    self.own = torch.cuda.Stream(self.device)
                    self.own.wait_stream(self.first)
            if caller is None or self.own is None or caller == self.own:  # CPU, one stream so far, or a nested span
                yield
                return
            self.own.wait_stream(caller)
            outer, self._caller = self._caller, caller
            try:
                with torch.cuda.stream(self.own):
                    yield
            finally:
                self._caller = outer
                if joined:
                    caller.wait_stream(self.own)
        finally:
            self.depth -= 1

    def use(self, *tensors: torch.Tensor) -> None:
        """Record on ``own`` the ``tensors`` the span uses (a record on a tensor's allocation stream is ignored)."""
        if self.own is not None:
            for tensor in tensors:
                tensor.record_stream(self.own)

    def hand_over(self, *tensors: torch.Tensor) -> None:
        """Record on the caller's stream the ``tensors`` it reads next."""
        if self.own is not None and self._caller is not None:
            for tensor in tensors:
                tensor.record_stream(self._caller)


def on_work_stream(joined: bool = True):
    """Run a method of an object whose ``streams`` is a :class:`WorkStream` as one span of it."""
    def decorate(method):
        @functools.wraps(method)
        def as_span(self, *args, **kwargs):
            streams = self.streams
            if streams.device.type != "cuda":  # (the fast path: only the depth)
                streams.depth += 1
                try:
                    return method(self, *args, **kwargs)
                finally:
                    streams.depth -= 1
            with streams.span(joined):
                return method(self, *args, **kwargs)
        return as_span
    return decorate
