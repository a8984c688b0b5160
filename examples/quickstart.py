"""Train a small GPT-2 with ZeRO stage 1 or 2 on N processes and print the loss and per-rank memory.

    torchrun --nproc_per_node 2 examples/quickstart.py [--stage 2] [--steps 30] [--dtype fp32|bf16] [--offload]

Runs on CPU (gloo) or, when every rank has a GPU, on CUDA (NCCL). Data is synthetic: a fixed random
corpus that the model memorises, so the loss visibly falls. No download is needed.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import transformers

from zeroimpl import ShardedOptimizer


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--offload", action="store_true",
                        help="keep master weights, optimizer state and gradient shard on the host (CPU offload)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    return parser.parse_args()


def synthetic_batch(step: int, micro: int, rank: int, vocab: int, batch_size=8, seq_len=64, corpus_size=64):
    """A batch from a fixed random corpus (the same on every rank) that the model can memorise, so the
    loss visibly falls; each rank and micro-batch reads different sequences."""
    corpus = torch.randint(0, vocab, (corpus_size, seq_len), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1_000 * step + 10 * micro + rank)
    ids = corpus[torch.randint(0, corpus_size, (batch_size,), generator=generator)]
    return {"input_ids": ids, "labels": ids}


def main():
    args = parse_args()
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if use_cuda else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    torch.manual_seed(0)  # the same initial weights on every rank
    config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=args.width, n_layer=args.layers,
                                     n_head=4, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).to(device=device, dtype=dtype)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = ShardedOptimizer([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                 torch.optim.AdamW, stage=args.stage, offload="cpu" if args.offload else None,
                                 lr=3e-3, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    if rank == 0:
        psi = optimizer.layout.numel
        print(f"GPT-2 with {psi / 1e6:.2f}M trainable parameters, ZeRO stage {args.stage}, {world_size} ranks, "
              f"{device.type}, {args.dtype}, {args.accum} micro-batches per step"
              f"{', CPU offload' if args.offload else ''}", flush=True)

    start = time.perf_counter()
    for step in range(args.steps):
        for micro in range(args.accum):
            batch = {k: v.to(device) for k, v in synthetic_batch(step, micro, rank, config.vocab_size).items()}
            loss = model(**batch).loss / args.accum
            if micro < args.accum - 1:
                with optimizer.accumulating():  # offload: sum on the device, cross to the host once per step
                    optimizer.backward(loss)
            else:
                optimizer.backward(loss)
        norm = optimizer.clip_grad_norm_(1.0)
        report = optimizer.memory_report()  # before the step: the gradients held (stage 2: the shard), no bucket alive
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item() * args.accum:.4f}  grad norm {norm.item():.3f}  "
                  f"lr {schedule.get_last_lr()[0]:.2e}", flush=True)
    elapsed = time.perf_counter() - start

    # one line per rank, in rank order
    for turn in range(world_size):
        if turn == rank:
            for place, kinds in (("device", report.device), ("host", report.host)):
                if kinds.total:
                    mib = {kind: value / 2 ** 20 for kind, value in kinds.as_dict().items() if value}
                    print(f"rank {rank} {place} memory (MiB): " + "  ".join(f"{k} {v:.2f}" for k, v in mib.items()),
                          flush=True)
        dist.barrier()
    if rank == 0:
        print(f"{args.steps} steps in {elapsed:.1f}s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
