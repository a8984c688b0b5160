"""One component's GPU work, issued from several CUDA streams, run in the order the host issued it.

The autograd engine runs a parameter's post-accumulate-grad hook on the stream of its ``AccumulateGrad`` node (the
stream the forward used the parameter on). A forward that runs a branch on a stream of its own (under
``torch.cuda.stream(side)``) therefore has the gradient reducer write one bucket buffer from several streams, and
launch its reduce-scatter from whichever stream the hook that completes the bucket runs on; the reduction is then
finished on yet another (the next launch's, the end of backward's, the step's). Each stream alone is ordered, the
streams are not: a launch could read a slot before another stream's write, a finish could read a buffer before
its writes (at world size 1 no collective orders anything), two streams could add into one gradient shard at once.

:class:`WorkStream` runs such a component's work on one stream:

* while every span of work comes from the same stream (the common case), on that stream, as if it were not there:
  a span costs one ``torch.cuda.current_stream()`` and a comparison;
* from the first span on another stream on, on a stream of its own (``own``, for the component's lifetime), each
  span after what its caller's stream has queued so far (the gradient it hands over) and after every earlier span.
  A *joined* span (the reducer's: the end of a backward pass, the step's, ``zero_grad``, and a cleared gradient's
  ``forget``) also makes its caller's stream wait for it; a hook's span does not, so that a compute stream does not
  wait on the GPU for another's queue or for the communication while backward runs. The host still can: a hook
  that must wait for the oldest reduction (the in-flight window) blocks the engine's thread until it is done, and
  so until ``own`` has passed everything it waits for.

``own`` comes from torch's pool of streams, which hands its streams out in turn: with many streams created, it may
be one the program uses too. Ordering stays right; that stream then also waits where ``own`` does.

The caching allocator hands a freed block out again to the stream it was allocated on, ordered after that stream's
work only: a tensor used on another stream must be recorded there. :meth:`WorkStream.use` records on the stream of
its own what the work uses, :meth:`WorkStream.hand_over` on the caller's stream what the caller reads next.
On CPU nothing happens.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch


class WorkStream:
    """Where one component's GPU work runs: ``first``, the stream all its spans came from so far (None: no span yet,
    or CPU); ``own``, its own stream once a span came from another (None until then)."""

    def __init__(self, device: Union[torch.device, str]):
        self.device = torch.device(device)
        self.first: Optional[torch.cuda.Stream] = None
        self.own: Optional[torch.cuda.Stream] = None
        self._caller: Optional[torch.cuda.Stream] = None  # the stream the current span came from
        self.depth = 0  # spans open now (on CPU too): work that needs one can tell it runs inside one

    @contextmanager
    def span(self, joined: bool = True) -> Iterator[None]:
        """Run the body's GPU work after what the current stream has queued and after every earlier span;
        ``joined``: the current stream's later work waits for it too."""
        self.depth += 1
        try:
            yield from self._span(joined)
        finally:
            self.depth -= 1

    def _span(self, joined: bool) -> Iterator[None]:
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

    def use(self, *tensors: torch.Tensor) -> None:
        """The current span's work uses ``tensors``, maybe allocated on another stream: with a stream of its own,
        record them there (a record on a tensor's own allocation stream is ignored by the allocator)."""
        if self.own is not None:
            for tensor in tensors:
                tensor.record_stream(self.own)

    def hand_over(self, *tensors: torch.Tensor) -> None:
        """The current span's caller reads ``tensors`` next, on its own stream: record them there."""
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
