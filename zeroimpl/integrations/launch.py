"""Run a function on N real processes joined by a process group, and collect what each returns.

Used by the test suite and by the comparison harness: one set of processes per call, so that every
implementation compared starts from a clean process (no state, allocator or hooks left by another).

Ranks are started with ``spawn`` (a new interpreter each), unless :func:`start_ranks_from_forkserver` was
called: then each rank is forked from one server process that has only imported the given modules (torch,
transformers, ...) and never runs anything else, so every rank is still a new process, but the seconds of
imports are paid once per session instead of once per rank.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import time
import traceback
from typing import Optional, Sequence

import torch
import torch.distributed as dist

_forkserver: Optional[multiprocessing.context.BaseContext] = None


def start_ranks_from_forkserver(preload: Sequence[str]) -> None:
    """Start the ranks of later :func:`run_distributed` calls from a fork server that imports ``preload`` once.

    The server starts at the next launch, with this process's environment and ``sys.path`` at that moment,
    imports the modules, freezes their objects out of the garbage collector's reach
    (:mod:`zeroimpl.integrations.freeze_heap`: a rank's collections then leave the shared pages alone) and then
    only forks. Call it before any launch. Modules whose import reads an
    environment variable that ``env`` of :func:`run_distributed` sets (DeepSpeed's ``DS_ACCELERATOR``)
    must not be preloaded: ``env`` is applied in the rank, after the fork. NCCL launches keep ``spawn``: a
    forked process cannot use CUDA if its parent initialised it.
    """
    global _forkserver
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*preload, "zeroimpl.integrations.freeze_heap"])
    _forkserver = context


def _child(rank: int, world_size: int, workdir: str, backend: str, env: dict, process_group_timeout: Optional[float],
           fn, args) -> None:
    os.environ.update({**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    result_path = os.path.join(workdir, f"rank{rank}.pt")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        bound = {} if process_group_timeout is None else {"timeout": datetime.timedelta(seconds=process_group_timeout)}
        dist.init_process_group(backend, init_method=f"file://{workdir}/store", rank=rank, world_size=world_size,
                                **bound)
        result = fn(rank, world_size, *args)
        if dist.is_initialized():  # fn may have torn the group down itself (a training script run whole does)
            dist.barrier()
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, result_path)
    except BaseException:  # report every failure to the parent, including assertion errors
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        raise


def run_distributed(world_size: int, fn, *args, timeout: float = 600.0, backend: str = "gloo",
                    env: Optional[dict] = None, process_group_timeout: Optional[float] = None) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable (a module-level function). ``env`` is added to each child's environment
    (with ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``, as torchrun sets them) before ``fn`` runs; each child
    uses ``OMP_NUM_THREADS`` threads (default 1, so that ranks do not fight over cores; set through
    ``torch.set_num_threads``, the parent's environment is left alone). Any failure or a
    hang past ``timeout`` seconds raises in the caller with every rank's traceback.
    ``process_group_timeout``: the process group's own timeout (``init_process_group(timeout=...)``), which
    bounds each collective (default: torch's); a rank waiting longer for its peers raises, naming the
    collective, instead of waiting out ``timeout``.
    """
    context = _forkserver if _forkserver is not None and backend != "nccl" else multiprocessing.get_context("spawn")
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    with tempfile.TemporaryDirectory() as workdir:
        processes = [context.Process(target=_child, args=(rank, world_size, workdir, backend, env,
                                                                  process_group_timeout, fn, args))
                     for rank in range(world_size)]
        deadline_hit = False
        try:
            for process in processes:
                process.start()
            deadline = time.monotonic() + timeout
            while any(p.is_alive() for p in processes):
                if any(p.exitcode not in (None, 0) for p in processes):
                    time.sleep(2.0)  # let the other ranks report their own error, then stop them
                    break
                if time.monotonic() > deadline:
                    deadline_hit = True
                    break
                time.sleep(0.05)
        finally:  # never leave ranks behind, hung in a collective (Ctrl-C, an error here)
            for process in processes:
                if process.is_alive():
                    process.kill()
                if process.pid is not None:
                    process.join()
        outcomes = []
        for rank in range(world_size):
            path = os.path.join(workdir, f"rank{rank}.pt")
            outcomes.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    errors = [f"rank {rank}: " + (o["error"] if o else "no result (killed or crashed)")
              for rank, o in enumerate(outcomes) if not (o and o["ok"])]
    if deadline_hit or errors:
        raise AssertionError(("timed out after %ss\n" % timeout if deadline_hit else "") + "\n".join(errors))
    return [o["result"] for o in outcomes]
