"""nanoGPT's training loop (karpathy/nanoGPT ``train.py``), unchanged but for the optimizer line, on zeroimpl or DDP.

    torchrun --nproc_per_node 2 examples/nanogpt_style.py                 # zeroimpl, stage 2
    torchrun --nproc_per_node 2 examples/nanogpt_style.py --ddp           # the reference: DDP + AdamW
    torchrun --nproc_per_node 2 examples/nanogpt_style.py --stage 1 --offload --resume

The loop keeps nanoGPT's idioms: the learning rate set in every param group each iteration, gradient
accumulation, ``torch.amp.GradScaler`` (``scaler.scale(loss).backward()``, ``scaler.unscale_``,
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, ``scaler.step``, ``scaler.update``),
``optimizer.zero_grad(set_to_none=True)``, evaluation on the master process only, and a checkpoint to resume
from. What changes for zeroimpl (the lines marked ``zeroimpl:``):

1. the optimizer: ``ShardedOptimizer(optim_groups, torch.optim.AdamW, ...)`` instead of
   ``torch.optim.AdamW(optim_groups, ...)``, and the model is not wrapped in DDP;
2. the checkpoint: every rank saves its own ``optimizer.state_dict()`` (each holds one shard of the state),
   or use ``zeroimpl.checkpoint.save_checkpoint``. A state dict of another rank is refused on every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os

import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel as DDP

from zeroimpl import ShardedOptimizer


def configure_optimizers(model, weight_decay, learning_rate, betas, *, zero_stage=None, offload=None):
    """nanoGPT's ``GPT.configure_optimizers``: decay the matrices, not the biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    optim_groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if zero_stage is None:
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)
    # zeroimpl: the one line that changes
    return ShardedOptimizer(optim_groups, torch.optim.AdamW, stage=zero_stage, offload=offload, lr=learning_rate,
                            betas=betas)


def get_lr(it, learning_rate=6e-3, warmup_iters=2, lr_decay_iters=20, min_lr=6e-4):
    """nanoGPT's cosine schedule with linear warmup."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


def get_batch(it, micro_step, rank, vocab, batch_size=4, block_size=32):
    """A batch from a fixed random corpus (the same on every rank), different per rank and micro-step."""
    corpus = torch.randint(0, vocab, (64, block_size), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1_000 * it + 10 * micro_step + rank)
    x = corpus[torch.randint(0, 64, (batch_size,), generator=generator)]
    return x, x


def build_model():
    """A small GPT-2 built from its config (no download), the same on every rank."""
    torch.manual_seed(1337)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # nanoGPT's dropout=0.0
    return transformers.GPT2LMHeadModel(config)


def train(model, optimizer, *, ddp, rank, iters, start_iter=0, gradient_accumulation_steps=2, grad_clip=1.0,
          scaler=None, autocast_dtype=None, checkpoint_at=None, out_dir=None, log=print):
    """nanoGPT's loop from ``start_iter`` to ``iters``, under autocast to ``autocast_dtype`` (None: none). Returns per iteration: the loss, the gradient norm, the loss
    scale. With ``checkpoint_at``, saves a checkpoint in ``out_dir`` after that many iterations."""
    raw_model = model.module if ddp else model
    vocab = raw_model.config.vocab_size
    master_process = rank == 0
    scaler = scaler or torch.amp.GradScaler("cpu", enabled=False)
    ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    history = []
    for iter_num in range(start_iter, iters):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if master_process and iter_num % 4 == 0:  # nanoGPT's estimate_loss, on the master process only
            model.eval()
            with torch.no_grad():
                x, y = get_batch(iter_num, 99, 0, vocab)
                log(f"iter {iter_num}: val loss {raw_model(input_ids=x, labels=y).loss.item():.4f}")
            model.train()
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            x, y = get_batch(iter_num, micro_step, rank, vocab)
            with ctx:
                loss = model(input_ids=x, labels=y).loss / gradient_accumulation_steps
            scaler.scale(loss).backward()
        norm = float("nan")
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).item()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        history.append((loss.item() * gradient_accumulation_steps, norm, scaler.get_scale()))
        if checkpoint_at is not None and iter_num + 1 == checkpoint_at:
            save_checkpoint(raw_model, optimizer, scaler, iter_num + 1, out_dir, rank, ddp)
    return history


def save_checkpoint(raw_model, optimizer, scaler, iter_num, out_dir, rank, ddp):
    """nanoGPT saves model and optimizer on the master process; zeroimpl: every rank saves its optimizer state."""
    if rank == 0:
        torch.save({"model": raw_model.state_dict(), "iter_num": iter_num, "scaler": scaler.state_dict(),
                    **({"optimizer": optimizer.state_dict()} if ddp else {})}, os.path.join(out_dir, "ckpt.pt"))
    if not ddp:  # zeroimpl: each rank holds its own shard of the optimizer state
        torch.save(optimizer.state_dict(), os.path.join(out_dir, f"optimizer.rank{rank}.pt"))
    dist.barrier()


def load_checkpoint(raw_model, optimizer, scaler, out_dir, rank, ddp):
    """Every rank reads the model and its optimizer state; returns the iteration to resume from."""
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=False)
    raw_model.load_state_dict(checkpoint["model"])
    scaler.load_state_dict(checkpoint["scaler"])
    state = checkpoint["optimizer"] if ddp else torch.load(os.path.join(out_dir, f"optimizer.rank{rank}.pt"),
                                                           weights_only=False)
    optimizer.load_state_dict(state)
    return checkpoint["iter_num"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ddp", action="store_true", help="the reference: DDP + torch.optim.AdamW")
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2])
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--resume", action="store_true", help="checkpoint halfway, then resume from it")
    parser.add_argument("--out-dir", default="runs/nanogpt_style")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.makedirs(args.out_dir, exist_ok=True)
    model = build_model()
    optimizer = configure_optimizers(model, 0.1, get_lr(0), (0.9, 0.95), zero_stage=None if args.ddp else args.stage,
                                     offload="cpu" if args.offload else None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)  # large: the first steps overflow in fp16
    wrapped = DDP(model) if args.ddp else model
    log = print if rank == 0 else (lambda *_: None)
    halfway = args.iters // 2 if args.resume else None
    history = train(wrapped, optimizer, ddp=args.ddp, rank=rank, iters=halfway or args.iters, scaler=scaler,
                    autocast_dtype=torch.float16, checkpoint_at=halfway, out_dir=args.out_dir, log=log)
    if args.resume:
        start = load_checkpoint(model, optimizer, scaler, args.out_dir, rank, args.ddp)
        history += train(wrapped, optimizer, ddp=args.ddp, rank=rank, iters=args.iters, start_iter=start,
                         scaler=scaler, autocast_dtype=torch.float16, log=log)
    for iter_num, (loss, norm, scale) in enumerate(history):
        log(f"iter {iter_num}: loss {loss:.4f}, grad norm {norm:.4f}, loss scale {scale:g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
