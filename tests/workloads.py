"""Tiny Hugging Face models, deterministic data and one training loop for DDP and for zeroimpl.

Everything here runs inside the spawned ranks. The reference is DDP + the same torch optimizer, with
``no_sync()`` on non-final micro-batches (the way Hugging Face Trainer accumulates).
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from zeroimpl import ShardedOptimizer

VOCAB = 128
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.99)}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


def build_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny model with the same initial weights on every rank and one frozen parameter."""
    import transformers

    torch.manual_seed(0)
    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if name == "gpt2":  # tied wte / lm_head
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)
        model = transformers.GPT2LMHeadModel(config)
        model.transformer.wpe.weight.requires_grad_(False)
    elif name == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=32, tie_word_embeddings=False, **ids)
        model = transformers.LlamaForCausalLM(config)
        model.model.layers[0].input_layernorm.weight.requires_grad_(False)
    elif name == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
        model = transformers.BertForMaskedLM(config)
        model.bert.embeddings.token_type_embeddings.weight.requires_grad_(False)
    else:
        raise ValueError(name)
    return model.to(dtype)


def param_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Two groups, as every Hugging Face recipe has: decayed matrices, undecayed biases and norms."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch(rank: int, step: int, micro: int, batch_size: int = 2, seq_len: int = 16) -> dict:
    generator = torch.Generator().manual_seed(100_000 * step + 100 * micro + rank)
    ids = torch.randint(1, VOCAB, (batch_size, seq_len), generator=generator)
    return {"input_ids": ids, "labels": ids}


@dataclass
class RunConfig:
    model: str = "gpt2"
    stage: Optional[int] = None  # None: the DDP reference
    optimizer: str = "adamw"
    steps: int = 4
    accum: int = 1
    clip: Optional[tuple[float, float]] = None  # (max_norm, norm_type)
    dtype: torch.dtype = torch.float32
    bucket_numel: int = 4096  # small, so that tiny models span several buckets
    zero_kwargs: dict = field(default_factory=dict)
    hint_accumulation: bool = False  # run non-final micro-batches under optimizer.accumulating()


def train(config: RunConfig, group: Optional[dist.ProcessGroup] = None) -> dict:
    """Train and return this rank's losses, gradient norms and final parameters (by name, fp32; fp64 models: fp64)."""
    rank = dist.get_rank()  # global rank: data differs between independent subgroups
    model = build_model(config.model, config.dtype)
    optimizer_class, kwargs = OPTIMIZERS[config.optimizer]
    groups = param_groups(model)
    if config.stage is None:
        ddp = DistributedDataParallel(model, process_group=group)
        optimizer = optimizer_class(groups, **kwargs)
        forward, backward = ddp, (lambda loss: loss.backward())
    else:
        optimizer = ShardedOptimizer(groups, optimizer_class, stage=config.stage, process_group=group,
                                     bucket_numel=config.bucket_numel, **config.zero_kwargs, **kwargs)
        forward, backward = model, optimizer.backward
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))

    losses, norms = [], []
    for step in range(config.steps):
        for micro in range(config.accum):
            last = micro == config.accum - 1
            context = contextlib.nullcontext()
            if config.stage is None and not last:
                context = ddp.no_sync()
            elif config.hint_accumulation and not last:
                context = optimizer.accumulating()
            with context:
                loss = forward(**batch(rank, step, micro)).loss
                backward(loss / config.accum)
            losses.append(loss.item())
        if config.clip is not None:
            max_norm, norm_type = config.clip
            if config.stage is None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
            else:
                norm = optimizer.clip_grad_norm_(max_norm, norm_type)
            norms.append(norm.item())
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    params = {name: p.detach().to(torch.promote_types(p.dtype, torch.float32), copy=True)
              for name, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def max_param_diff(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def bitwise_equal(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and a["norms"] == b["norms"] and all(
        torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
