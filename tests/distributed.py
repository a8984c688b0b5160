"""Run a function on N real processes joined by a gloo process group, and collect what each returns."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


def _child(rank: int, world_size: int, workdir: str, fn, args) -> None:
    torch.set_num_threads(1)
    result_path = os.path.join(workdir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, result_path)
    except BaseException:  # report every failure to the parent, including assertion errors
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        raise


def run_distributed(world_size: int, fn, *args, timeout: float = 600.0) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable (a module-level function). Any failure or a hang past ``timeout`` seconds
    raises in the caller with every rank's traceback.
    """
    context = multiprocessing.get_context("spawn")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children: 2 ranks share 2 cores
    with tempfile.TemporaryDirectory() as workdir:
        processes = [context.Process(target=_child, args=(rank, world_size, workdir, fn, args))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        deadline_hit = False
        while any(p.is_alive() for p in processes):
            if any(p.exitcode not in (None, 0) for p in processes):
                time.sleep(2.0)  # let the other ranks report their own error, then stop them
                break
            if time.monotonic() > deadline:
                deadline_hit = True
                break
            time.sleep(0.05)
        for process in processes:
            if process.is_alive():
                process.kill()
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
