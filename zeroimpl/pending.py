"""Issued communication and the wait for it: :class:`Pending`, returned by every collective of :mod:`zeroimpl.comm`. A
collective that fails (a peer died) or does not finish within ``timeout`` seconds (a peer hangs) raises
:class:`CollectiveError` on this rank instead of blocking forever (``timeout=None``: the process group's timeout). On
CUDA most waits are the current stream's, bounded only by the group's timeout (NCCL's watchdog aborts the process);
``timeout`` bounds those where the host blocks anyway (docs/design.md's "Host waits"), so a collective that hangs raises
by the next step's check. A failed collective, or a ``finish`` that raised (out of memory), fails the Pending: every
later wait raises the same :class:`CollectiveError`, since what the collective writes may be half-landed."""

from __future__ import annotations

import datetime
import math
import time
import weakref
from typing import Callable, Optional

from . import shutdown

HOST_POLL_SECONDS = 5e-5  # Pending.wait_on_host's polling interval


class CollectiveError(RuntimeError):
    """A collective failed or timed out: another rank died, hangs or diverged."""


class Pending:
    """Issued communication: ``works`` to wait for (none: it finished when issued), then ``finish()``, run at most
    once. ``timeout`` bounds the wait for all of ``works`` together; ``lent``: the aliases ``works`` were given
    (``comm._aliases``)."""

    def __init__(self, works: list, name: str, timeout: Optional[float], *, finish: Optional[Callable[[], None]] = None,
                 buffers: tuple = (), lent: tuple = (), on_stream: bool = False, reports_completion: bool = False):
        self.works, self.name, self.timeout, self.finish = works, name, timeout, finish
        self.buffers = buffers  # scratch tensors alive until the wait (for memory accounting)
        self.lent = lent
        self._hand_over = weakref.finalize(self, shutdown.handed_to_gloo, *(t for t in lent if t.device.type == "cpu"))
        self._hand_over.atexit = False  # (one alive at exit holds them still: no wait for them)
        self.on_stream = on_stream  # an accelerator's collective: wait() makes the current stream wait
        self.reports_completion = reports_completion  # its works' is_completed() says so before any wait()
        self.failure: Optional[str] = None  # why a work or the finish failed, raised by every wait from then on
        self._finishing = False

    def arrived(self) -> bool:
        """Whether every work has finished, as far as the backend tells without a wait: a collective's work
        does (NCCL's, gloo's), gloo's point-to-point works do not (False until :meth:`wait`)."""
        return not self.works or (self.reports_completion and all(work.is_completed() for work in self.works))

    def wait_on_host(self) -> None:
        """Block this thread, not a device stream, until every work is done, bounded by ``timeout``; then
        :meth:`wait`. For CUDA, ``wait()`` alone would stall every kernel queued after it (the rest of backward)
        behind the communication; and where the host reads the result next, this wait is bounded, a read is not."""
        if self.failure is not None:
            raise CollectiveError(self.failure)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        # (on CPU, wait() blocks the host, bounded already; gloo's point-to-point works report no completion before it)
        while self.on_stream and self.works and not all(work.is_completed() for work in self.works):
            if deadline is not None and time.monotonic() > deadline:
                raise self._failed(f"did not finish within its timeout of {self.timeout} s")
            time.sleep(HOST_POLL_SECONDS)
        self.wait()

    def wait(self) -> None:
        """Wait for every work (on an accelerator the current stream waits, unbounded), then run ``finish``."""
        if self.failure is not None:
            raise CollectiveError(self.failure)
        bounded = self.timeout is not None and not self.on_stream
        deadline = time.monotonic() + self.timeout if bounded else None
        try:
            for work in self.works:
                if deadline is None:
                    work.wait()
                else:
                    # the work's wait takes whole milliseconds and rounds down: round up, or it raises early
                    left_ms = max(math.ceil((deadline - time.monotonic()) * 1000), 1)
                    work.wait(timeout=datetime.timedelta(milliseconds=left_ms))
        except RuntimeError as error:
            bound = f"within its timeout of {self.timeout} s" if bounded else "within the process group's timeout"
            raise self._failed(f"failed or did not finish {bound} ({error})") from error
        self.works, self.buffers, self.lent = [], (), ()
        self._hand_over()
        if self.finish is not None and not self._finishing:  # (a wait from inside it returns at once)
            self._finishing = True
            try:
                self.finish()
            except CollectiveError as error:  # (a collective the finish waits for: its message says it all)
                self.failure = str(error)
                raise
            except BaseException as error:  # (out of memory; a KeyboardInterrupt stays one, the Pending failed)
                self.failure = (f"ShardedOptimizer's {self.name} arrived, but landing its result raised {error!r}: "
                                "what it writes may be half-written, so this rank cannot continue. Restart the job "
                                "from the last checkpoint (zeroimpl.checkpoint.load_checkpoint)")
                if isinstance(error, Exception):
                    raise CollectiveError(self.failure) from error
                raise
            finally:
                self._finishing = False
            self.finish = None

    @property
    def done(self) -> bool:  # every work finished and ``finish`` run to its end
        return not self.works and self.finish is None

    def _failed(self, what: str) -> CollectiveError:
        self.failure = (f"ShardedOptimizer's {self.name} {what}. Another rank has probably died, hangs, or runs a "
                        "different number of backward passes or steps; this rank cannot continue. Restart the job "
                        "from the last checkpoint (zeroimpl.checkpoint.load_checkpoint)")
        return CollectiveError(self.failure)
