"""A training job that ends as a user's script does, for tests/test_shutdown.py: a small MLP, ZeRO stage 2,
6 steps (the last one's parameter all-gathers still in flight when the loop ends), rank 0 saves the parameters
with ``torch.save`` (which waits for them), then ``dist.barrier()``, ``dist.destroy_process_group()`` and a plain
return (no ``os._exit``).

    torchrun --nproc_per_node 2 tests/exit_script.py OUT [--keep]

``--keep``: the optimizer stays alive until the interpreter exits (as in a script written at module level),
so that its finalizer runs at exit; without, it goes when ``main()`` returns.
"""

import argparse
import os

import torch
import torch.distributed as dist

from zeroimpl import ShardedOptimizer

KEPT = []


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 8))
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    if args.keep:
        KEPT.append(optimizer)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(6):
        inputs = torch.randn(4, 32, generator=generator)
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        torch.save({name: p.detach().clone() for name, p in model.named_parameters()},
                   os.path.join(args.out, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
