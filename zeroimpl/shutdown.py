"""Exit without an abort: before the interpreter finalizes, wait for gloo's workers to drop zeroimpl's objects. A gloo
worker drops a work (``ProcessGroupGloo::AsyncWork``) just after completing it, and outlives ``destroy_process_group()``
(``torch.distributed.nn.functional``'s default arguments hold the group). A work holds its tensors' Python objects
(torch >= 2.10) and the issuing thread's TorchFunctionModes, :mod:`zeroimpl.inflight`'s guard among them (so the user's
own ``dist.barrier()`` holds it, and keeps the works then in progress alive). A worker dropping one once finalization
began asks for the GIL, is ended by ``pthread_exit``, and unwinds through the work's noexcept destructor into
``std::terminate``: "terminate called without an active exception", SIGABRT after a good run (torch 2.13, Python 3.11).

So at exit, after every optimizer's finalizer and only while objects registered by :func:`handed_to_gloo` are still held
(each collective's alias of a CPU tensor; a guard taken off the mode stack), zeroimpl releases the GIL for
``WORKER_SECONDS``, which lets any worker drop any Python object, then waits at most ``EXIT_WAIT_SECONDS`` for the
registered objects to be freed. ``tests/test_shutdown.py`` forces the race."""

from __future__ import annotations

import gc
import time
import weakref

EXIT_WAIT_SECONDS = 5.0  # the longest wait at exit: a work still running, or held in Python, is left be
WORKER_SECONDS = 0.2  # a worker lets go within 1 ms once it runs, but may wait tens of ms for a core (4 ranks, 2 cores)

_held: weakref.WeakSet = weakref.WeakSet()  # registered objects not freed yet


def handed_to_gloo(*objects) -> None:
    """Register ``objects``: zeroimpl holds them no longer, a gloo work may still."""
    _held.update(objects)


def _wait_for_gloo() -> None:
    if not _held:
        return  # nothing zeroimpl handed to gloo is held still
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    time.sleep(WORKER_SECONDS)  # releases the GIL to any worker letting go of a Python object, registered or not
    if _held:
        gc.collect()  # one held only by cyclic garbage (an exception's traceback) is no work's to free
        while _held and time.monotonic() < deadline:
            time.sleep(1e-3)  # releases the GIL


class _Process:
    """Alive until exit; its finalizer, made on import, runs at exit after every optimizer's (newest run first)."""


_PROCESS = _Process()
weakref.finalize(_PROCESS, _wait_for_gloo)
