"""Work that one component issues from several CUDA streams, run on the GPU in the order the host issued it.

The autograd engine runs a parameter's post-accumulate-grad hook on the stream of its ``AccumulateGrad`` node (the
stream the forward used the parameter on). A forward that runs a branch on a stream of its own (under
``torch.cuda.stream(side)``) therefore has the gradient reducer write one bucket buffer from several streams, and
launch its reduce-scatter from whichever stream the hook that completes the bucket runs on; the reduction is then
finished on yet another (the next launch's, the end of backward's, the step's). Each stream alone is ordered, the
streams are not: a launch could read a slot before another stream's write, a finish could read a buffer before its
writes (at world size 1 no collective orders anything).

:class:`StreamChain` restores one order: each *link* (a span of the component's work, entered on the current
stream) starts after the previous link ended, whatever streams they ran on. And the caching allocator hands a
freed block out again to the stream it was allocated on, ordered after that stream's work only: a tensor used
on another stream is recorded there (:meth:`StreamChain.use`).

Cost: with one stream, the common case, a link costs one ``torch.cuda.current_stream()`` and a comparison, and
``use`` nothing. Once a second stream has been seen, each link ends with an event recorded on its stream, which the
next link waits for if it runs on another, so the other streams' own work (the rest of backward) is not held up
behind it; the first change of stream waits for the whole previous stream instead. On CPU nothing happens.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch


class StreamChain:
    """The links of one component's GPU work, in host order: ``last`` ran the latest link (None: none yet, or CPU),
    ``ended`` marks its end (None until a second stream has been seen)."""

    def __init__(self, device: Union[torch.device, str]):
        self.device = torch.device(device)
        self.last: Optional[torch.cuda.Stream] = None
        self.ended: Optional[torch.cuda.Event] = None
        self.several = False  # whether links ever ran on two streams: only then are events and records needed

    @contextmanager
    def link(self) -> Iterator[None]:
        """Run the body's GPU work, on the current stream, after the previous link and before the next."""
        if self.device.type != "cuda":
            yield
            return
        stream = torch.cuda.current_stream(self.device)
        if self.last is not None and stream != self.last:
            self.several = True
            if self.ended is not None:
                stream.wait_event(self.ended)
            else:
                stream.wait_stream(self.last)
        self.last = stream
        try:
            yield
        finally:
            if self.several:
                self.ended = torch.cuda.Event()
                self.ended.record(stream)

    def use(self, *tensors: torch.Tensor) -> None:
        """The current link uses ``tensors`` (maybe allocated on another stream): record them on its stream, so that
        their memory is not handed out again before the link's work has run. A record on the stream a tensor was
        allocated on is ignored by the allocator."""
        if self.several:
            for tensor in tensors:
                tensor.record_stream(self.last)


def linked(method):
    """Run a method of an object whose ``streams`` is a :class:`StreamChain` as one link of it."""
    @functools.wraps(method)
    def as_link(self, *args, **kwargs):
        if self.streams.device.type != "cuda":
            return method(self, *args, **kwargs)
        with self.streams.link():
            return method(self, *args, **kwargs)
    return as_link
