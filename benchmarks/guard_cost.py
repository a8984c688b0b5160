"""What the in-flight all-gather guard (``zeroimpl/inflight.py``) costs the next forward once the gathers landed.

At 2 ranks on gloo, zeroimpl stage 2 on GPT-2, trained in separate launches (the guard is per thread: a second
model in the same process would pay for the first's): with ``overlap_param_gather=False`` (every all-gather
waited for in ``step()``, no guard), and with the default overlap. After each ``step()`` both sleep
``--settle`` seconds, so that the gathers have landed and what the forward pays is the guard, not the
communication; then the next training forward (with autograd) is
timed. Its cost per torch call is the difference over the number of torch functions the forward calls from
Python (what a ``TorchFunctionMode`` such as the guard sees, counted in one untimed forward). Per collective algorithm (``ZEROIMPL_COLLECTIVES``): ``native`` (gloo's own all-gather, which reports
its completion, as NCCL's does: the guard leaves at the first module forward) and ``pairwise`` (point-to-point
exchanges, the default on one CPU node, which cannot report it: the guard stays until the forward has touched
every bucket).

    python benchmarks/guard_cost.py                     # GPT-2 small, 100 steps per run, 4 runs (about 2 minutes)
    python benchmarks/guard_cost.py --size tiny         # a forward of small kernels, where a per-call cost shows
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zeroimpl.integrations.launch import run_distributed  # noqa: E402
from zeroimpl.integrations.models import batch, build_model, param_groups  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "guard_cost.md")


class _CountCalls(torch.overrides.TorchFunctionMode):
    """Counts the torch functions called from Python while it is on the mode stack."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _forward_times(rank: int, world_size: int, size: str, steps: int, settle: float,
                   overlap: bool) -> tuple[float, int]:
    """(the median training forward in seconds, the torch calls of one forward)."""
    from zeroimpl import ShardedOptimizer

    model = build_model("gpt2", size)
    optimizer = ShardedOptimizer(param_groups(model, 0.01), torch.optim.AdamW, stage=2, lr=1e-4,
                                 overlap_param_gather=overlap)
    times = []
    for step in range(steps):
        torch.distributed.barrier()
        time.sleep(settle)
        started = time.perf_counter()
        loss = model(**batch("gpt2", size, rank, step, 0, 4)).loss
        if step >= 2:
            times.append(time.perf_counter() - started)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    optimizer.finish_param_gathers()
    with _CountCalls() as counter:
        model(**batch("gpt2", size, rank, 0, 0, 4))
    return statistics.median(times), counter.calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--settle", type=float, default=0.05, help="seconds between step() and the next forward")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    rows = []
    for algorithm in ("native", "pairwise"):
        (waited, calls), (overlapped, _) = (
            max(run_distributed(2, _forward_times, args.size, args.steps, args.settle, overlap, timeout=1800,
                                env={"ZEROIMPL_COLLECTIVES": algorithm}))  # the slower rank's median
            for overlap in (False, True))
        rows.append(f"| {algorithm} | {waited * 1e3:.2f} | {overlapped * 1e3:.2f} | {overlapped / waited:.3f} | "
                    f"{calls} | {(overlapped - waited) / calls * 1e6:+.2f} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "# The in-flight all-gather guard's cost to the next forward", "",
        f"Measured on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, 2 ranks, "
        f"OMP_NUM_THREADS=1 per rank, by `python benchmarks/guard_cost.py --size {args.size} --steps {args.steps} "
        f"--settle {args.settle}`: GPT-2 {args.size}, micro-batch 4, stage 2; the median training forward of the "
        f"slower rank over {args.steps - 2} steps, {args.settle} s after `step()` (the gathers have landed). "
        "*waited*: `overlap_param_gather=False` (no guard); *overlapped*: the default. *torch calls*: the torch "
        "functions one forward calls from Python, each of which the guard sees while it is on the stack; *guard µs "
        "per call*: the difference of the two forwards over them.", "",
        "| all-gather | waited forward ms | overlapped forward ms | overlapped / waited | torch calls | "
        "guard µs per call |",
        "| --- | --- | --- | --- | --- | --- |", *rows, ""])
    with open(args.out, "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
