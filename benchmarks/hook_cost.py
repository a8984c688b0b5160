"""What zeroimpl's gradient hooks cost a backward, per gradient (issue 54, point 6).

    python benchmarks/hook_cost.py [--rounds 30] [--passes 10] [--layers 20]

A model of ``--layers`` blocks of ``Linear(16, 16)`` and ``LayerNorm(16)`` (4 parameters each: 80 by default), so
small that a backward is mostly its per-gradient overhead, on 2 CPU ranks (gloo, OMP_NUM_THREADS=1). Five set-ups
are built side by side in one job, by ``step_profile.set_up``: the bare model ("compute": no hooks), DDP, DDP with
zeroimpl's stage 1 in torch's optimizer's place (the one-line swap), and zeroimpl at stages 1 and 2. They take turns
in ``--rounds`` rounds of ``--passes`` timed backward passes each (each followed, untimed, by its step and
``zero_grad``), the order rotating from round to round. Per set-up, the median over rounds of each round's median
backward on rank 0, and what it adds per gradient: over the bare backward, and for the swap over DDP's. Stage 2's
hooks do its reduction's work (each gradient scaled into its bucket, the reduce-scatter when a bucket completes: here
one, at the end), stage 1's only note the gradient. Writes ``hook_cost.md`` under ``--out`` (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from step_phases import run_ranks
from step_profile import STAGE_1_UNDER_DDP, set_up

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUPS = ("compute", "DDP", STAGE_1_UNDER_DDP, "zeroimpl stage 1", "zeroimpl stage 2")  # step_profile's set-ups


def rank_main(rounds: int, passes: int, layers: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
                                     for _ in range(layers)])

    setups = {}
    for name in SETUPS:
        net = model()
        setups[name] = (net, *set_up(name, net))
    x = torch.randn(4, 16)
    medians = {name: [] for name in SETUPS}
    for round_index in range(rounds + 1):  # (round 0 warms up)
        shift = round_index % len(SETUPS)
        for name in SETUPS[shift:] + SETUPS[:shift]:
            net, network, optimizer = setups[name]
            times = []
            for _ in range(passes):
                loss = network(x).sum()
                dist.barrier()
                start = time.perf_counter()
                loss.backward()
                times.append(time.perf_counter() - start)
                if optimizer is None:
                    net.zero_grad()
                else:
                    optimizer.step()
                    optimizer.zero_grad()
            if round_index:
                medians[name].append(statistics.median(times) * 1e3)
    if dist.get_rank() == 0:
        print("BACKWARD " + json.dumps({"medians": medians, "params": 4 * layers}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)  # internal: one rank
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    if args.rank_job:
        return rank_main(args.rounds, args.passes, args.layers)
    import torch

    measured = run_ranks(__file__, ["--rank-job", "--rounds", str(args.rounds), "--passes", str(args.passes),
                                    "--layers", str(args.layers)], 2, "BACKWARD")
    backward = {name: statistics.median(values) for name, values in measured["medians"].items()}
    params = measured["params"]
    lines = ["# What the gradient hooks cost a backward", "",
             f"Command: `python benchmarks/hook_cost.py --rounds {args.rounds} --passes {args.passes} --layers "
             f"{args.layers}` (see its docstring); {params} parameters, 2 CPU ranks (gloo, OMP_NUM_THREADS=1), "
             f"torch {torch.__version__}, {os.cpu_count()} CPU cores. Rank 0.", "",
             "| set-up | backward ms (median of rounds) | over the bare backward (compute), µs per gradient "
             "| over DDP's, µs per gradient |", "|---|---|---|---|"]
    for name in SETUPS:
        over_bare = "-" if name == "compute" else f"{(backward[name] - backward['compute']) * 1e3 / params:+.1f}"
        over_ddp = f"{(backward[name] - backward['DDP']) * 1e3 / params:+.1f}" if name == STAGE_1_UNDER_DDP else "-"
        lines.append(f"| {name} | {backward[name]:.3f} | {over_bare} | {over_ddp} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hook_cost.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
