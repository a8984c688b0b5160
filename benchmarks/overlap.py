"""Step time of ``overlap_param_gather`` (the default) against all-gathers waited for in ``step()`` and DDP.

In the same processes and run, on gloo: DDP + AdamW, zeroimpl stage 2 with ``overlap_param_gather=False``,
and zeroimpl stage 2 with the parameter all-gathers overlapped with the next forward, each for ``--steps``
steps (the first two not timed) of forward + backward + step on GPT-2 (``zeroimpl.integrations.models``
sizes), at world sizes 2 and 4. Reported: the median step time and the ratios (overlapped / waited, and each
/ DDP). The modes take turns step by step, so that drifts of the machine hit them alike.

    python benchmarks/overlap.py                         # GPT-2 tiny, small and base at 2 and 4 ranks (~6 min)
    python benchmarks/overlap.py --sizes small           # a quick run
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

RESULTS = os.path.join(os.path.dirname(__file__), "results", "overlap.md")
MODES = ("DDP", "zeroimpl stage 2, all-gathers waited for in step()", "zeroimpl stage 2, overlapped all-gather")


def _measure(rank: int, world_size: int, size: str, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from zeroimpl import ShardedOptimizer

    runs = {}
    for mode in MODES:
        model = build_model("gpt2", size)
        if mode == "DDP":
            forward = DistributedDataParallel(model)
            optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-4)
            backward = torch.Tensor.backward
        else:
            optimizer = ShardedOptimizer(param_groups(model, 0.01), torch.optim.AdamW, stage=2, lr=1e-4,
                                         overlap_param_gather="overlapped" in mode)
            forward, backward = model, optimizer.backward
        runs[mode] = (forward, optimizer, backward, [])
    for step in range(steps):
        for mode, (forward, optimizer, backward, times) in runs.items():
            torch.distributed.barrier()
            started = time.perf_counter()
            backward(forward(**batch("gpt2", size, rank, step, 0, 4)).loss)
            optimizer.step()
            optimizer.zero_grad()
            if step >= 2:
                times.append(time.perf_counter() - started)
    for mode, (_, optimizer, _, _) in runs.items():
        if mode != "DDP":
            optimizer.finish_param_gathers()
    return {mode: statistics.median(times) for mode, (_, _, _, times) in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small", "base"],
                        choices=["tiny", "small", "base", "large"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        for world_size in args.world_sizes:
            by_rank = run_distributed(world_size, _measure, size, args.steps, timeout=3600)
            median = {mode: max(r[mode] for r in by_rank) for mode in MODES}  # the slowest rank sets the pace
            ddp, waited, overlapped = (median[mode] for mode in MODES)
            rows.append(f"| {size} | {world_size} | {ddp * 1e3:.1f} | {waited * 1e3:.1f} | {overlapped * 1e3:.1f} | "
                        f"{overlapped / waited:.3f} | {waited / ddp:.3f} | {overlapped / ddp:.3f} |")
    text = "\n".join([
        "# Parameter all-gather overlapped with the next forward (`overlap_param_gather`, the default)", "",
        f"Measured on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, OMP_NUM_THREADS=1 "
        f"per rank, by `python benchmarks/overlap.py --sizes {' '.join(args.sizes)} --steps {args.steps}`: GPT-2, "
        f"micro-batch 4, AdamW, stage 2; median step time (forward + backward + step) of the slowest rank over "
        f"{args.steps - 2} timed steps, the modes taking turns step by step in the same processes. *waited*: "
        f"`overlap_param_gather=False`, every all-gather waited for at the end of `step()`.", "",
        "| GPT-2 | world size | DDP ms | waited ms | overlapped ms | overlapped / waited | waited / DDP | "
        "overlapped / DDP |", "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows, ""])
    with open(RESULTS, "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
