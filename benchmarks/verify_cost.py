"""What ``ShardedOptimizer(verify_every=K)`` costs: one cross-rank parameter check against one training step.

Each check (``verify_ranks_agree()``) reads every parameter once (an int64 sum of its bits per bucket) and
all-reduces two int64 numbers per bucket. Measured on GPT-2 (``zeroimpl.integrations.models`` sizes) at world size 2
on gloo, stage 2, AdamW: the median of the timed checks and of the timed training steps (forward,
backward, step, zero_grad), in the same processes and run. The cost per step of ``verify_every=K`` is the
check's time divided by K.

    python benchmarks/verify_cost.py                 # GPT-2 base and large
    python benchmarks/verify_cost.py --sizes small   # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zeroimpl.integrations.launch import run_distributed  # noqa: E402
from zeroimpl.integrations.models import SIZES, build_model  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _measure(rank: int, world_size: int, size: str, steps: int, checks: int) -> dict:
    from zeroimpl import ShardedOptimizer

    model = build_model("gpt2", size)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-4)
    seq_len = SIZES[size][4]
    vocab = SIZES[size][3]
    generator = torch.Generator().manual_seed(rank)
    step_times = []
    for step in range(steps + 1):  # the first step allocates the optimizer state: not timed
        ids = torch.randint(0, vocab, (4, seq_len), generator=generator)
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step:
            step_times.append(time.perf_counter() - started)
    check_times = []
    for _ in range(checks):
        torch.distributed.barrier()
        started = time.perf_counter()
        optimizer.verify_ranks_agree()
        check_times.append(time.perf_counter() - started)
    return {"parameters": sum(p.numel() for p in model.parameters()), "buckets": len(optimizer.layout.buckets),
            "step_s": statistics.median(step_times), "check_s": statistics.median(check_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["base", "large"], choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=5, help="timed training steps (after one untimed)")
    parser.add_argument("--checks", type=int, default=10, help="timed checks")
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        print(f"GPT-2 {size}: {args.steps} steps, {args.checks} checks at world size 2 ...", flush=True)
        by_rank = run_distributed(2, _measure, size, args.steps, args.checks)
        worst = max(by_rank, key=lambda r: r["check_s"])
        rows.append({"size": size, **worst, "step_s": max(r["step_s"] for r in by_rank)})
        print(f"  check {worst['check_s'] * 1e3:.1f} ms, step {rows[-1]['step_s'] * 1e3:.0f} ms", flush=True)
    header = (f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {os.cpu_count()} cores, torch "
              f"{torch.__version__}, 2 gloo ranks with OMP_NUM_THREADS=1, by `python benchmarks/verify_cost.py "
              f"--sizes {' '.join(args.sizes)}`.")
    lines = ["# Cost of the cross-rank parameter check (`verify_every`)", "", header, "",
             "| GPT-2 | parameters | buckets | one check | one training step | check / step | per step at K=100 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        ratio = row["check_s"] / row["step_s"]
        lines.append(f"| {row['size']} | {row['parameters'] / 1e6:.1f}M | {row['buckets']} | "
                     f"{row['check_s'] * 1e3:.1f} ms | {row['step_s'] * 1e3:.0f} ms | {ratio:.2%} | {ratio / 100:.3%} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "verify.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, "verify.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
