"""Where the host time of a small step goes: a Python profile of DDP's and zeroimpl's training steps (issue 54).

    python benchmarks/step_profile.py [--steps 40] [--top 25]

The model is the issue's tiny GPT-2 (2 layers, 64 wide, 2 heads, vocabulary 2048), 4 x 64 tokens per rank, on 2
CPU ranks (gloo, OMP_NUM_THREADS=1), AdamW, no clipping, in fresh processes under torchrun. On so small a model
the compute is short, and what an implementation adds per step -- checks, hooks, guards, small collectives,
Python bookkeeping per bucket and per parameter -- is what the step costs beyond it.

Per implementation ("compute": forward and backward of the bare model, no communication, no step; DDP +
AdamW; zeroimpl stages 1 and 2), rank 0 first times ``--steps`` steps without a profiler (median ms per step,
after 5 warm-up steps), then runs as many under ``cProfile`` and reports, per step, the host time spent inside
each zeroimpl module (its functions' own time, ``tottime``, summed by file) and the functions with the most own
time, zeroimpl's or torch's. cProfile slows Python code more than C++ code, so the profile shows where time
goes, and the unprofiled milliseconds how much there is. Writes benchmarks/results/step_profile.md.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

from step_phases import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("compute", "DDP", "zeroimpl stage 1", "zeroimpl stage 2")
STAGE_1_UNDER_DDP = "zeroimpl stage 1 under DDP"
WARMUP = 5


def model_and_batches(rank: int, steps: int):
    """The tiny GPT-2 (the same weights on every rank) and ``steps`` batches of 4 x 64 tokens for ``rank``."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=2048, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 2048, (4, 64), generator=generator) for _ in range(steps)]
    return model, batches


def set_up(kind: str, model):
    """``(network, optimizer)`` of one of ``KINDS`` over ``model`` (in a process group): the bare model and no
    optimizer ("compute"), DDP + torch AdamW, or zeroimpl's AdamW at stage 1 or 2; or ``STAGE_1_UNDER_DDP``: DDP
    kept, zeroimpl's AdamW at stage 1 in torch's AdamW's place (the one-line swap)."""
    import torch

    from zeroimpl import ShardedOptimizer

    if kind == "compute":
        return model, None
    if kind == "DDP":
        return torch.nn.parallel.DistributedDataParallel(model), torch.optim.AdamW(model.parameters())
    if kind == STAGE_1_UNDER_DDP:
        return torch.nn.parallel.DistributedDataParallel(model), ShardedOptimizer(model.parameters(),
                                                                                  torch.optim.AdamW, stage=1)
    return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=int(kind[-1]))


def train_step(model, network, optimizer, ids) -> None:
    """Forward, backward and (but for "compute") the optimizer's step, then the gradients cleared."""
    network(input_ids=ids, labels=ids).loss.backward()
    if optimizer is None:
        model.zero_grad()
    else:
        optimizer.step()
        optimizer.zero_grad()


def _where(code: tuple) -> str:
    """``zeroimpl/<module>.py:function`` / ``torch/...:function`` / a builtin's name, from a pstats key."""
    filename, line, function = code
    for package in ("zeroimpl", "torch", "transformers"):
        marker = os.sep + package + os.sep
        if marker in filename:
            return f"{package}/{filename.split(marker, 1)[1]}:{function}"
    return function if filename == "~" else f"{os.path.basename(filename)}:{function}"


def rank_main(kind: str, steps: int, top: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, batches = model_and_batches(rank, WARMUP + 2 * steps)
    network, optimizer = set_up(kind, model)

    def train(ids) -> None:
        train_step(model, network, optimizer, ids)

    for ids in batches[:WARMUP]:
        train(ids)
    times = []
    for ids in batches[WARMUP:WARMUP + steps]:
        dist.barrier()
        start = time.perf_counter()
        train(ids)
        times.append((time.perf_counter() - start) * 1e3)
    profile = cProfile.Profile()
    dist.barrier()
    profile.enable()
    for ids in batches[WARMUP + steps:]:
        train(ids)
    profile.disable()
    if rank == 0:
        stats = pstats.Stats(profile).stats  # key -> (primitive calls, calls, tottime, cumtime, callers)
        by_module: dict[str, float] = {}
        functions = []
        for code, (_, calls, own, _, _) in stats.items():
            where = _where(code)
            if where.startswith("zeroimpl/"):
                module = where.split(":", 1)[0]
                by_module[module] = by_module.get(module, 0.0) + own
            functions.append((own, calls, where))
        total = sum(own for own, _, _ in functions)
        functions.sort(reverse=True)
        print("PROFILE " + json.dumps({
            "ms_per_step": statistics.median(times), "profiled_ms_per_step": total * 1e3 / steps,
            "modules": {m: t * 1e3 / steps for m, t in sorted(by_module.items(), key=lambda i: -i[1])},
            "functions": [(where, own * 1e3 / steps, calls / steps) for own, calls, where in functions[:top]]}),
            flush=True)
    dist.destroy_process_group()


def run(kind: str, args) -> dict:
    return run_ranks(__file__, ["--rank-of", kind, "--steps", str(args.steps), "--top", str(args.top)], 2, "PROFILE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rank-of", choices=KINDS, help=argparse.SUPPRESS)  # internal: one rank of one kind
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "step_profile.md"))
    args = parser.parse_args()
    if args.rank_of:
        return rank_main(args.rank_of, args.steps, args.top)
    import torch

    results = {}
    for kind in KINDS:
        results[kind] = run(kind, args)
        print(f"{kind}: {results[kind]['ms_per_step']:.2f} ms per step", flush=True)
    compute = results["compute"]["ms_per_step"]
    lines = ["# Where the host time of a small step goes", "",
             f"Command: `python benchmarks/step_profile.py --steps {args.steps} --top {args.top}`; tiny GPT-2 (2 "
             "layers, 64 wide, vocabulary 2048), 4 x 64 tokens per rank, 2 CPU ranks (gloo, OMP_NUM_THREADS=1), "
             f"AdamW, no clipping; torch {torch.__version__}, {os.cpu_count()} CPU cores. Rank 0; milliseconds "
             "per step.", "",
             "| implementation | ms per step (no profiler) | over compute | profiled ms per step |",
             "|---|---|---|---|"]
    for kind in KINDS:
        result = results[kind]
        lines.append(f"| {kind} | {result['ms_per_step']:.2f} | {result['ms_per_step'] - compute:+.2f} | "
                     f"{result['profiled_ms_per_step']:.2f} |")
    for kind in KINDS[2:]:
        result = results[kind]
        lines += ["", f"## {kind}: own time per step in each zeroimpl module (profiled ms)", "",
                  "| module | ms |", "|---|---|"]
        lines += [f"| {module} | {ms:.3f} |" for module, ms in result["modules"].items()]
        lines += ["", f"## {kind}: the {args.top} functions with the most own time per step (profiled)", "",
                  "| function | ms | calls |", "|---|---|---|"]
        lines += [f"| `{where}` | {ms:.3f} | {calls:.1f} |" for where, ms, calls in result["functions"]]
    lines += ["", "## DDP: the functions with the most own time per step (profiled)", "",
              "| function | ms | calls |", "|---|---|---|"]
    lines += [f"| `{where}` | {ms:.3f} | {calls:.1f} |" for where, ms, calls in results["DDP"]["functions"][:12]]
    with open(args.out, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
