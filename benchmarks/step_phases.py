"""Where a training step's time goes: forward, backward, clipping and optimizer step, DDP against zeroimpl.

    python benchmarks/step_phases.py [--size base] [--micro-batch 4] [--steps 16] [--rounds 2] [--world-sizes 1 2]

Explains the step-time ratios of benchmarks/peers.py and benchmarks/overhead.py. Per world size and round,
"compute" (forward and backward of the bare model: no communication, no step), DDP + AdamW, zeroimpl stage 1
and stage 2 (AdamW) each train the harness's GPT-2 on CPU ranks (gloo, OMP_NUM_THREADS=1) in fresh processes,
one after the other, so that slow drifts of the machine hit every implementation alike. Median milliseconds
per phase on rank 0 after 3 warm-up steps; a phase ends when the call returns, so communication overlapped
with backward is in ``backward``, and a stage-1 reduce-scatter in ``clip``. Writes
benchmarks/results/step-phases.md.

Sharding saves (1 - 1/N) of the optimizer step and changes which collectives run; everything else is
the same work. The table shows how large each of those is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("compute", "DDP", "zeroimpl stage 1", "zeroimpl stage 2")
PHASES = ("forward", "backward", "clip", "step", "total")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "step-phases.md")


def _ms(value: float) -> str:
    """Milliseconds as the table shows them: whole from 100 up, else to 0.01 (a tiny model's phases)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.2f}"


def rank_main(kind: str, size: str, micro_batch: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from zeroimpl.integrations.models import batch, build_model
    from zeroimpl import ShardedOptimizer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_model("gpt2", size)
    settings = {"lr": 1e-4, "weight_decay": 0.0}
    if kind == "compute":
        network, optimizer = model, None
    elif kind == "DDP":
        network = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), **settings)
    else:
        network = model
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=int(kind[-1]), **settings)
    times = {phase: [] for phase in PHASES}
    for step in range(steps):
        inputs = batch("gpt2", size, rank, step, 0, micro_batch)
        dist.barrier()
        marks = [time.perf_counter()]
        loss = network(**inputs).loss
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        if kind == "compute":
            pass
        elif kind == "DDP":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            optimizer.clip_grad_norm_(1.0)
        marks.append(time.perf_counter())
        if optimizer is None:
            model.zero_grad()
        else:
            optimizer.step()
            optimizer.zero_grad()
        marks.append(time.perf_counter())
        if step >= 3:
            for phase, start, end in zip(PHASES, marks, marks[1:]):
                times[phase].append((end - start) * 1e3)
            times["total"].append((marks[-1] - marks[0]) * 1e3)
    if rank == 0:
        print("PHASES " + json.dumps({phase: statistics.median(v) for phase, v in times.items()}), flush=True)
    dist.destroy_process_group()


def run_ranks(script: str, flags: list[str], world_size: int, tag: str) -> dict:
    """``script flags`` on ``world_size`` CPU ranks under torchrun (OMP_NUM_THREADS=1 each): the JSON its rank 0
    printed on the line starting with ``tag``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size),
               os.path.abspath(script), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    line = next(line for line in completed.stdout.splitlines() if line.startswith(tag + " "))
    return json.loads(line[len(tag) + 1:])


def run(kind: str, world_size: int, args) -> dict[str, float]:
    return run_ranks(__file__, ["--rank-of", kind, "--size", args.size, "--micro-batch", str(args.micro_batch),
                                "--steps", str(args.steps)], world_size, "PHASES")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="base")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rank-of", choices=KINDS, help=argparse.SUPPRESS)  # internal: one rank of one kind
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.rank_of:
        return rank_main(args.rank_of, args.size, args.micro_batch, args.steps)
    import torch

    out = "" if os.path.abspath(args.out) == DEFAULT_OUT else f" --out {os.path.relpath(args.out, ROOT)}"
    lines = ["# Step phases: DDP against zeroimpl", "",
             f"Command: `python benchmarks/step_phases.py --size {args.size} --micro-batch {args.micro_batch} "
             f"--steps {args.steps} --rounds {args.rounds} --world-sizes {' '.join(map(str, args.world_sizes))}"
             f"{out}`; "
             f"GPT-2 {args.size}, fp32, AdamW, clip 1.0, torch {torch.__version__}, {os.cpu_count()} CPU cores, "
             "gloo. Milliseconds on rank 0: per round the median of the timed steps, then the mean over rounds; "
             "`vs DDP` is the total over DDP's."]
    for world_size in args.world_sizes:
        rounds = {kind: [] for kind in KINDS}
        for round_index in range(args.rounds):
            for kind in KINDS:
                rounds[kind].append(run(kind, world_size, args))
                print(f"world size {world_size}, round {round_index + 1}: {kind}: "
                      + ", ".join(f"{p} {_ms(rounds[kind][-1][p])}" for p in PHASES), flush=True)
        lines += ["", f"## World size {world_size}", "",
                  "| implementation | " + " | ".join(PHASES) + " | vs DDP | rounds' totals |",
                  "|---|" + "---|" * (len(PHASES) + 2)]
        means = {kind: {p: statistics.mean(r[p] for r in rounds[kind]) for p in PHASES} for kind in KINDS}
        for kind in KINDS:
            lines.append(f"| {kind} | " + " | ".join(_ms(means[kind][p]) for p in PHASES)
                         + f" | {means[kind]['total'] / means['DDP']['total']:.2f}x | "
                         + ", ".join(_ms(r['total']) for r in rounds[kind]) + " |")
    with open(args.out, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
