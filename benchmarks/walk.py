"""How far one gradient and one checkpoint load travel through the core: the modules of ``zeroimpl`` they enter,
and how often they come back to a module already left (issue 54's newcomer's walk, counted).

Two CPU ranks (gloo) train a one-layer model with ShardedOptimizer (stage 2, AdamW) one step, save a checkpoint,
and on rank 0 trace (``sys.setprofile``) two walks:

* ``gradient``: one gradient, from its post-accumulate-grad hook to its gradient shard: the backward of a model
  of one parameter (a bias-free ``Linear``), after a first step, so that the walk is the common one.
* ``load``: ``zeroimpl.checkpoint.load_checkpoint(directory, optimizer, model)`` of that checkpoint.

The walk is the sequence of zeroimpl modules whose functions are called, consecutive repeats merged. ``entered``:
how many distinct modules; ``returns``: steps back to a module the walk had left earlier. Run it at any revision
(``PYTHONPATH=<checkout>``) to compare; it prints a Markdown section headed by the revision it ran::

    python benchmarks/walk.py                                         # this checkout
    git worktree add /tmp/before 948cfa3 && PYTHONPATH=/tmp/before python benchmarks/walk.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _module_of(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith("zeroimpl") and not name.startswith("zeroimpl.integrations") else None


def _walk(run) -> dict:
    """Trace ``run()``: the zeroimpl modules called into, in order, consecutive repeats merged."""
    walk = []

    def profile(frame, event, arg):
        if event == "call":
            module = _module_of(frame)
            if module is not None and (not walk or walk[-1] != module):
                walk.append(module)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    returns = sum(1 for i, module in enumerate(walk) if module in walk[:max(i - 1, 0)])
    return {"entered": len(set(walk)), "returns": returns, "steps": len(walk), "walk": walk}


def _rank(rank: int, world_size: int, store: str, directory: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    from zeroimpl import ShardedOptimizer
    from zeroimpl.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8, bias=False)  # one parameter: its backward is one gradient's walk
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    batch = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    save_checkpoint(directory, optimizer, model)
    loss = model(batch).square().mean()
    walks = {"gradient": _walk(loss.backward)}
    optimizer.zero_grad()
    walks["load"] = _walk(lambda: load_checkpoint(directory, optimizer, model))
    if rank == 0:
        with open(out, "w") as file:
            json.dump(walks, file, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the walks as JSON here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "walks.json")
        mp.spawn(_rank, args=(2, os.path.join(scratch, "store"), os.path.join(scratch, "checkpoint"), out), nprocs=2)
        with open(out) as file:
            walks = json.load(file)
    import zeroimpl
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(zeroimpl.__file__)))
    revision = subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or "(not a git checkout)"
    print(f"## zeroimpl at {revision}\n")
    for name, walk in walks.items():
        print(f"- **{name}**: {walk['entered']} modules entered, {walk['returns']} returns to a module left earlier "
              f"({walk['steps']} steps): " + " > ".join(module.removeprefix("zeroimpl.") for module in walk["walk"]))
    print()
    if args.out:
        with open(args.out, "w") as file:
            json.dump(walks, file, indent=1)


if __name__ == "__main__":
    main()
