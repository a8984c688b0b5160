"""Tiny Hugging Face models (the comparison's, zeroimpl.integrations.models), deterministic data and one
training loop for DDP and for zeroimpl (its micro-batch passes are the comparison's ``run_micro_batches``);
a small plain-torch model for the training-loop idioms; the tolerances of 16-bit runs against fp32.

Everything here runs inside the spawned ranks. The reference is DDP + the same torch optimizer, with
``no_sync()`` on non-final micro-batches (the way Hugging Face Trainer accumulates).
"""

from __future__ import annotations

import contextlib
import time

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from zeroimpl import ShardedOptimizer, comm
from zeroimpl.integrations import models, muon
from zeroimpl.integrations.micro_batches import run_micro_batches

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.99)}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
}


class NormalizedSGD(torch.optim.Optimizer):
    """Each parameter moves by ``lr`` times its gradient over the gradient's norm: not elementwise (the norm
    needs the whole gradient), unknown to zeroimpl, so it must be marked ``per_parameter``."""

    def __init__(self, params, lr: float = 0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / (p.grad.norm().item() + 1e-12))


class TransposedMomentum(torch.optim.Optimizer):
    """SGD with momentum kept transposed (a (n, m) buffer for an (m, n) matrix): a state of as many elements
    as the parameter but another shape, which checkpoints must move whole, not reshape."""

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "transposed" not in state:
                    state["transposed"] = torch.zeros_like(p.T)
                state["transposed"].mul_(group["momentum"]).add_(p.grad.T)
                p.add_(state["transposed"].T, alpha=-group["lr"])


# whole-parameter optimizers for the hidden matrices, the rest stepping with "adamw"
MATRIX_OPTIMIZERS = {
    "muon": (torch.optim.Muon, {"lr": 0.02}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
    "normalized_sgd": (NormalizedSGD, {"lr": 0.01}),
    "transposed_momentum": (TransposedMomentum, {"lr": 0.01}),
}
VOCAB, SEQUENCE_LENGTH = models.vocabulary_and_length("gpt2", "tiny")
FROZEN = {  # one frozen parameter per model, as fine-tuning recipes have
    "gpt2": "transformer.wpe.weight",  # (GPT-2's input and output embeddings are tied)
    "llama": "model.layers.0.input_layernorm.weight",
    "bert": "bert.embeddings.token_type_embeddings.weight",
}


class PlainLanguageModel(torch.nn.Module):
    """A causal language model in plain torch, for the jobs the tests start with torchrun (a fresh interpreter per
    rank, where importing transformers would take about 4 s of the 6): the tiny GPT-2's vocabulary, width and
    sequence length, learned positions (frozen, as :data:`FROZEN` freezes GPT-2's), two pre-norm MLP blocks (2x
    wide: two 2048-element matrices fill one bucket of 4096, so buckets hold several parameters, as GPT-2's do) and
    a head tied to the token embedding, initialised as GPT-2 is (normal, std 0.02). ``forward(input_ids, labels)``
    returns an object with the next-token cross-entropy as ``.loss``, as a Hugging Face model does."""

    def __init__(self, hidden: int = 32, blocks: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.tokens = torch.nn.Embedding(VOCAB, hidden)
        self.positions = torch.nn.Embedding(SEQUENCE_LENGTH, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                torch.nn.Linear(2 * hidden, hidden)) for _ in range(blocks))
        self.norm = torch.nn.LayerNorm(hidden)
        for module in self.modules():
            if isinstance(module, (torch.nn.Embedding, torch.nn.Linear)):
                torch.nn.init.normal_(module.weight, std=0.02)
        self.positions.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        hidden = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            hidden = hidden + block(hidden)
        logits = self.norm(hidden) @ self.tokens.weight.T
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss)


def build_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The comparison's "tiny" model of family ``name`` (same initial weights on every rank) with one frozen
    parameter."""
    model = models.build_model(name, "tiny", dtype)
    model.get_parameter(FROZEN[name]).requires_grad_(False)
    return model


def param_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Two groups, as every Hugging Face recipe has: decayed matrices, undecayed biases and norms. Frozen
    parameters stay in them (the optimizer must leave them alone)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def matrix_param_groups(model: torch.nn.Module, matrix_optimizer: str) -> list[dict]:
    """Hidden matrices with ``MATRIX_OPTIMIZERS[matrix_optimizer]``, the rest as :func:`param_groups` (decay /
    no decay), as Muon recipes train."""
    optimizer_class, kwargs = MATRIX_OPTIMIZERS[matrix_optimizer]
    matrices, rest = muon.split_hidden_matrices(model, param_groups(model))
    return [{"params": matrices, "optimizer": optimizer_class, **kwargs}] + rest


def batch(rank: int, step: int, micro: int, batch_size: int = 2) -> dict:
    """Deterministic token ids, different per rank, step and micro-batch (any family: same vocabulary)."""
    return models.batch("gpt2", "tiny", rank, step, micro, batch_size)


GLOBAL_BATCH = 12  # sequences per step, split evenly over 1, 2, 3, 4 or 6 ranks


def global_batch(step: int) -> torch.Tensor:
    """The step's fixed global batch (token ids): runs at different world sizes see the same data."""
    generator = torch.Generator().manual_seed(7_000 + step)
    return torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQUENCE_LENGTH), generator=generator)


def local_batch(step: int, rank: int, world_size: int) -> dict:
    """This rank's even slice of the step's global batch: the averaged gradient is the same at any world
    size."""
    per_rank = GLOBAL_BATCH // world_size
    ids = global_batch(step)[rank * per_rank:(rank + 1) * per_rank]
    return {"input_ids": ids, "labels": ids}


def train_on_global_batch(model, optimizer, rank: int, world_size: int, steps) -> None:
    """ShardedOptimizer steps on this rank's slices of the global batches of ``steps``, clipping at 1.0."""
    for step in steps:
        optimizer.backward(model(**local_batch(step, rank, world_size)).loss)
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()


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
    matrix_optimizer: Optional[str] = None  # a MATRIX_OPTIMIZERS key: that class for the hidden matrices
    device: str = "cpu"  # "cuda": this rank's GPU (tests/test_cuda.py)


def train(config: RunConfig, group: Optional[dist.ProcessGroup] = None) -> dict:
    """Train and return this rank's losses, gradient norms and final parameters (by name, fp32; fp64 models: fp64)."""
    rank = dist.get_rank()  # global rank: data differs between independent subgroups
    model = build_model(config.model, config.dtype).to(config.device)
    optimizer_class, kwargs = OPTIMIZERS[config.optimizer]
    if config.matrix_optimizer is None:
        groups = param_groups(model)
    else:
        groups = matrix_param_groups(model, config.matrix_optimizer)
    if config.stage is None:  # one plain torch optimizer per class, over that class's groups
        ddp = DistributedDataParallel(model, process_group=group)
        classes = [g.get("optimizer", optimizer_class) for g in groups]
        plain = [{k: v for k, v in g.items() if k != "optimizer"} for g in groups]
        optimizers = [cls([g for g, c in zip(plain, classes) if c is cls], **(kwargs if cls is optimizer_class else {}))
                      for cls in dict.fromkeys(classes)]
        forward, backward = ddp, (lambda loss: loss.backward())
    else:
        optimizers = [ShardedOptimizer(groups, optimizer_class, stage=config.stage, process_group=group,
                                       bucket_numel=config.bucket_numel, **config.zero_kwargs, **kwargs)]
        forward, backward = model, optimizers[0].backward
    optimizer = optimizers[0]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: min(1.0, (step + 1) / 3)) for o in optimizers]

    if config.stage is None:
        non_final = ddp.no_sync
    else:
        non_final = optimizer.accumulating if config.hint_accumulation else contextlib.nullcontext
    losses, norms = [], []
    for step in range(config.steps):
        micro_batches = [{k: v.to(config.device) for k, v in batch(rank, step, micro).items()}
                         for micro in range(config.accum)]
        losses += run_micro_batches(forward, backward, micro_batches, non_final)
        if config.clip is not None:
            max_norm, norm_type = config.clip
            if config.stage is None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
            else:
                norm = optimizer.clip_grad_norm_(max_norm, norm_type)
            norms.append(norm.item())
        for each, schedule in zip(optimizers, schedules):
            each.step()
            schedule.step()
            each.zero_grad()
    # (the last step's all-gathers may still be in flight: p.detach() waits for them, no call needed)
    params = {name: p.detach().to("cpu", torch.promote_types(p.dtype, torch.float32), copy=True)
              for name, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


class SmallNet(torch.nn.Module):
    """Four layers, a head and an auxiliary head that only some idioms use (an unused task head, an expert
    that got no tokens); the same initial weights on every rank. Its data: :func:`small_batch`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 16)
        self.body = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, 4)
        self.aux_head = torch.nn.Linear(16, 4)

    def forward(self, x, use_aux=False, checkpointing=None):
        h = torch.tanh(self.embed(x))
        for layer in self.body:
            if checkpointing is None:
                h = torch.tanh(layer(h))
            else:
                h = checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), h,
                               use_reentrant=checkpointing == "reentrant")
        if checkpointing is None:
            out = self.head(h)
        else:  # the first gradients of backward come from inside a checkpointed segment
            out = checkpoint(self.head, h, use_reentrant=checkpointing == "reentrant")
        if use_aux:
            out = out + self.aux_head(h)
        return (out - 0.5).square().mean()


def small_batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    """:class:`SmallNet`'s input: deterministic, different per rank, step and micro-batch."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 8, generator=generator)


# 16-bit runs against the fp32 run of the same optimizer and settings (GPT-2, AdamW lr 1e-2, clipping,
# accumulation; tests/test_precision_mixed.py, tests/test_cuda.py):
# * losses within HALF_LOSS_ATOL (bf16 keeps 8 significant bits; measured 1.3e-3 for bf16, 5e-4 fp16);
# * parameters within HALF_PARAM_RTOL in relative L2 norm (relative_l2) over the model after 6 steps
#   (measured 1.6e-2 bf16, 6e-3 fp16): at lr 1e-2 six Adam steps move weights by several times their init
#   std of 0.02, and Adam turns 16-bit rounding of near-zero gradients into steps of up to lr.
HALF_LOSS_ATOL = 5e-3
HALF_PARAM_RTOL = 3e-2


def relative_l2(params: dict, reference: dict) -> float:
    """The L2 norm of ``params - reference`` over every parameter, relative to that of ``reference``."""
    diff = sum(((params[n] - reference[n]) ** 2).sum() for n in params) ** 0.5
    return (diff / sum((reference[n] ** 2).sum() for n in reference) ** 0.5).item()


def max_param_diff(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def bitwise_equal(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and a["norms"] == b["norms"] and all(
        torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def issue_gathers_late_on_rank_1(rank: int, seconds: float = 0.1):
    """Test instrument: on rank 1, each parameter all-gather is issued ``seconds`` after the one before (a slow
    peer), so that rank 0's gathers of bucket k are surely in flight for (k + 1) * ``seconds`` after its step()
    returns. The real collectives still run. Returns the function that restores the real all-gather."""
    original = comm.all_gather

    def late(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)
    if rank == 1:
        comm.all_gather = late

    def restore() -> None:
        comm.all_gather = original
    return restore


def overlap_pair() -> tuple[list[torch.nn.Module], list[ShardedOptimizer]]:
    """Two GPT-2s built alike, stepped with AdamW at stage 2: the first waits for its all-gathers in step(), the
    second leaves them in flight (``overlap_param_gather``), for tests that compare reads of the two."""
    models = [build_model("gpt2"), build_model("gpt2")]
    return models, [ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-2,
                                     overlap_param_gather=overlap) for model, overlap in zip(models, (False, True))]


def example_module(file_name: str):
    """``examples/<file_name>`` imported as a module (the tests run its functions in their ranks)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", file_name)
    spec = importlib.util.spec_from_file_location(os.path.splitext(file_name)[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
