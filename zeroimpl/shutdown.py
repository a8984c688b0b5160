"""Exit without an abort: before the interpreter finalizes, wait for gloo's worker threads to let go of
zeroimpl's Python objects.

gloo runs a collective (``ProcessGroupGloo::AsyncWork``: all-reduce, broadcast, barrier, native reduce-scatter
and all-gather) on a worker thread, which drops its reference to the work just after completing it. A work
holds Python objects: its tensors (in torch >= 2.10 C++ holding a tensor keeps its Python object alive, and
letting go of it decrefs that object) and, in its copy of the issuing thread's state, the TorchFunctionModes
on the stack, among them :mod:`zeroimpl.inflight`'s guard (so even the user's own ``dist.barrier()`` holds
it). A barrier also holds weak references to the works in progress when it was issued, which defer their
destruction (and their tensors' release) until the barrier goes, on the worker thread. The worker threads
outlive ``destroy_process_group()``: torch keeps the process group in default arguments
(``torch.distributed.nn.functional``, imported by the first torch optimizer). If a worker lets go of such an
object after the interpreter has begun to finalize, the decref asks for the GIL, Python ends the thread with
``pthread_exit``, and its unwinding through the work's (noexcept) destructor calls ``std::terminate``:
"terminate called without an active exception", SIGABRT after a good run (torch 2.13, Python 3.11).

At exit, after every optimizer's finalizer, zeroimpl therefore waits -- only where objects it handed to gloo are
still held (:func:`handed_to_gloo` registers them: a fresh alias of a CPU tensor for each collective,
:func:`zeroimpl.comm._aliases`, once its wait returned or its Pending was dropped; a guard taken off the mode
stack): it releases the GIL for ``WORKER_SECONDS``, which lets any worker letting go of any Python object take
it then (DDP's bucket tensors, the user's all-gather outputs kept alive by a later barrier's reference to their
work: a core dump of a plain Trainer + DDP run at 4 ranks showed ``~AsyncBarrierWork`` ->
``~AsyncAllgatherWork`` -> ``decref`` -> ``pthread_exit``), and then waits on until the registered objects are
freed (at most ``EXIT_WAIT_SECONDS``). A process that handed gloo nothing of zeroimpl's, or whose works have
let go of it all (NCCL-only jobs, a process that only imported zeroimpl), exits without a wait.
``tests/test_shutdown.py`` makes the race certain: a gloo all-gather completes while the main thread holds
the GIL up to the interpreter's exit.
"""

from __future__ import annotations

import gc
import time
import weakref

EXIT_WAIT_SECONDS = 5.0  # the longest wait at exit: a work still running, or held in Python, is left be
# the GIL-free wait of an exit where gloo holds zeroimpl's objects: a worker lets go within a millisecond once
# it runs, but on a loaded machine (2 cores, 4 ranks and their launcher exiting together) it may wait tens of
# milliseconds for a core
WORKER_SECONDS = 0.2

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
        _wait_until(deadline)


def _wait_until(deadline: float) -> None:
    while _held and time.monotonic() < deadline:
        time.sleep(1e-3)  # releases the GIL


class _Process:
    """Alive until exit; its finalizer, created on import (before any optimizer's), runs after theirs:
    weakref.finalize runs the finalizers alive at exit in reverse order of creation, before finalization."""


_PROCESS = _Process()
weakref.finalize(_PROCESS, _wait_for_gloo)
