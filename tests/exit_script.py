"""A training job that ends as a user's script does, for tests/test_clean_exit.py: tiny GPT-2, ZeRO stage 2,
6 steps, rank 0 saves the parameters with ``torch.save``, then ``dist.barrier()``,
``dist.destroy_process_group()`` and a plain return (no ``os._exit``).

    torchrun --nproc_per_node 2 tests/exit_script.py OUT [--keep]

``--keep``: the optimizer stays alive until the interpreter exits (as in a script written at module level),
so that its finalizer runs at exit; without, it goes when ``main()`` returns.
"""

import argparse
import os

import torch
import torch.distributed as dist
import transformers

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
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    if args.keep:
        KEPT.append(optimizer)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(6):
        ids = torch.randint(0, 256, (4, 32), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        torch.save({name: p.detach().clone() for name, p in model.named_parameters()},
                   os.path.join(args.out, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
