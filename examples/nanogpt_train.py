"""A training script laid out as nanoGPT's ``train.py`` (karpathy/nanoGPT), on DDP, for a CPU harness.

Module-level code in nanoGPT's order -- configuration globals overridden by ``--key=value``, DDP detected from
torchrun's environment, ``torch.manual_seed(1337 + rank)`` on every rank (so the ranks initialise different
weights and draw different batches), the model built or resumed, ``model.configure_optimizers(...)``,
``torch.compile``, the DDP wrap, ``raw_model``, the loop with the learning rate set in every param group, the
master process alone evaluating and deciding to save ``ckpt.pt`` (when the validation loss improves, or always),
gradient accumulation through ``require_backward_grad_sync``, clipping and a GradScaler -- so that the zeroimpl
recipe (``examples/nanogpt_zeroimpl.patch``, docs/usage.md#nanogpts-trainpy) is shown and tested on the lines it changes:

    torchrun --standalone --nproc_per_node 2 examples/nanogpt_train.py            # DDP + AdamW, as nanoGPT
    cp examples/nanogpt_train.py /tmp/train.py && git apply --directory=/tmp examples/nanogpt_zeroimpl.patch ...

The CPU harness (not nanoGPT's): gloo and float32, a tiny GPT defined here (nanoGPT's ``model.py`` layout:
tied embedding and head, decay / no-decay param groups), a synthetic corpus instead of ``train.bin``, and
``--dump=PATH``, where the master process saves its per-iteration losses and the final weights.
"""

import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
# default config values (nanoGPT's names)
out_dir = "out"
eval_interval = 2
log_interval = 1
eval_iters = 2
always_save_checkpoint = False  # save only when the validation loss improves: the master process decides
init_from = "scratch"  # or "resume"
gradient_accumulation_steps = 4  # over all ranks, as nanoGPT counts it
batch_size = 4
block_size = 32
n_layer, n_head, n_embd, vocab_size = 2, 4, 64, 96
dropout = 0.0
learning_rate = 6e-3
max_iters = 6
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 2
lr_decay_iters = 20
min_lr = 6e-4
backend = "gloo"
device = "cpu"
dtype = "float32"
compile = False
dump = ""  # harness: where the master process saves its losses and final weights
# -----------------------------------------------------------------------------
for arg in sys.argv[1:]:  # nanoGPT's configurator: --key=value overrides a global of the same type
    key, value = arg[2:].split("=", 1)
    default = globals()[key]
    globals()[key] = (value == "True") if isinstance(default, bool) else type(default)(value)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        batch, time_steps, channels = x.shape
        q, k, v = (t.view(batch, time_steps, n_head, channels // n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(n_embd, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, time_steps, channels))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as nanoGPT's
        for module in self.modules():  # nanoGPT's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """nanoGPT's: decay every parameter of 2 or more dimensions, not biases and norms; fused on CUDA."""
        params = [p for p in self.parameters() if p.requires_grad]
        optim_groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        extra_args = dict(fused=True) if device_type == "cuda" else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank  # each process gets a different seed
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

corpus = {split: (torch.arange(4096) * 7 + torch.randint(3, (4096,), generator=torch.Generator().manual_seed(n)))
          % vocab_size for n, split in enumerate(["train", "val"])}  # a pattern with noise: learnable


def get_batch(split):
    data = corpus[split]
    ix = torch.randint(len(data) - block_size, (batch_size,))  # this rank's generator: per-rank batches
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


iter_num = 0
best_val_loss = 1e9
if init_from == "scratch":
    model = GPT()
elif init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location=device)
    model = GPT()
    state_dict = checkpoint["model"]
    for k in list(state_dict):  # nanoGPT strips torch.compile's prefix
        if k.startswith("_orig_mod."):
            state_dict[k[len("_orig_mod."):]] = state_dict.pop(k)
    model.load_state_dict(state_dict)
    iter_num = checkpoint["iter_num"]
    best_val_loss = checkpoint["best_val_loss"]
model.to(device)

scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))

optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == "resume":
    optimizer.load_state_dict(checkpoint["optimizer"])
checkpoint = None  # free up memory

if compile:
    unoptimized_model = model
    model = torch.compile(model)

if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


X, Y = get_batch("train")
t0 = time.time()
raw_model = model.module if ddp else model
history = []  # harness: the master's losses, per iteration
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {
                    "model": raw_model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                }
                print(f"saving checkpoint to {out_dir}")
                torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))

    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        history.append(lossf)
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1
    if iter_num > max_iters:
        break

if dump and master_process:  # harness
    torch.save({"losses": history, "model": {k: v.detach().clone() for k, v in raw_model.state_dict().items()}},
               dump)
if ddp:
    destroy_process_group()
