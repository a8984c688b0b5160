"""Whole-parameter shards for Muon + AdamW: padding, Newton-Schulz work per rank, optimizer state per rank.

Two parts, both on Hugging Face configs with Muon on the hidden matrices (the 2-D weights of linear layers)
and AdamW on embeddings, head, norms and biases, default buckets (``bucket_numel=2**22``):

* **Layout** (no training, parameters on the meta device, so 7B fits): for GPT-2 (124M, ``GPT2Config()``),
  TinyLlama-1.1B and LLaMA-2-7B shapes at world sizes 2, 4 and 8 -- the padding the reduce-scatter and
  all-gather carry (% of Ψ), the Newton-Schulz flops of the busiest rank over the mean (``m*n*min(m,n)`` per
  matrix), the same for a flat layout that cuts matrices at element boundaries (every rank holding part of
  a matrix must run its whole Newton-Schulz, as DeepSpeed's ZeRO Muon does), and the optimizer state of the
  fullest rank over (total state)/N, from ``estimate_memory`` (exact, see tests/test_accounting_estimate.py).
* **Measured** on GPT-2 (124M) at world sizes 2 and 4 (gloo, stage 2, one training step): the elements each
  step reduce-scatters and all-gathers, counted with ``zeroimpl.integrations.collectives.CollectiveCounter``
  (``ZEROIMPL_COLLECTIVES=native``: one collective per bucket), against Ψ; and each rank's optimizer state from
  ``memory_report()`` against ``estimate_memory``'s prediction for that rank.

    python benchmarks/whole_parameter.py             # both parts (about 3 minutes on 2 cores)
    python benchmarks/whole_parameter.py --layout    # the layout part only (seconds)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zeroimpl import estimate_memory  # noqa: E402
from zeroimpl.integrations.launch import run_distributed  # noqa: E402
from zeroimpl.integrations.muon import split_hidden_matrices  # noqa: E402
from zeroimpl.layout import build_layout, trainable_specs  # noqa: E402
from zeroimpl.optimizer_kinds import step_work  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "whole_parameter.md")
WORLD_SIZES = (2, 4, 8)


def configs() -> dict:
    import transformers

    return {
        "GPT-2 124M": (transformers.GPT2LMHeadModel, transformers.GPT2Config()),
        "TinyLlama-1.1B": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
            num_key_value_heads=4, vocab_size=32000)),
        "LLaMA-2-7B": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=32, vocab_size=32000)),
    }


def muon_groups(model: torch.nn.Module) -> list[dict]:
    matrices, rest = split_hidden_matrices(model, [{"params": list(model.parameters()), "weight_decay": 0.0}])
    return [{"params": matrices, "optimizer": torch.optim.Muon, "lr": 0.02}] + rest


def newton_schulz_imbalance(layout, specs, world_size: int) -> float:
    """Busiest rank's Newton-Schulz work over the mean, every rank that holds part of a matrix running it all."""
    work = [sum(specs[i].work for i in {p.param_index for p in layout.pieces(r)})
            for r in range(world_size)]
    return max(work) / (sum(spec.work for spec in specs) / world_size)


def layout_rows() -> list[str]:
    rows = []
    for name, (model_class, config) in configs().items():
        with torch.device("meta"):
            model = model_class(config)
        groups = muon_groups(model)
        muon_work = step_work(torch.optim.Muon)
        _, whole_specs = trainable_specs(groups, [muon_work, None])
        # the same matrices cut flat: their work is still counted, on every rank holding part of one
        flat_specs = [s.__class__(s.group_index, s.dtype, s.numel, False, s.work) for s in whole_specs]
        psi = sum(s.numel for s in whole_specs)
        total_state = estimate_memory(groups, 1, 2).device.optimizer_state
        for world_size in WORLD_SIZES:
            whole = build_layout(whole_specs, world_size, 2 ** 22)
            flat = build_layout(flat_specs, world_size, 2 ** 22)
            state = max(estimate_memory(groups, world_size, 2, rank=r).device.optimizer_state
                        for r in range(world_size))
            rows.append(f"| {name} | {psi / 1e6:.1f}M | {world_size} | "
                        f"{100 * (whole.padded_numel - psi) / psi:.2f}% | "
                        f"{newton_schulz_imbalance(whole, whole_specs, world_size):.3f} | "
                        f"{newton_schulz_imbalance(flat, flat_specs, world_size):.3f} | "
                        f"{state / (total_state / world_size):.3f} |")
    return rows


def _measure(rank: int, world_size: int) -> dict:
    import transformers

    from zeroimpl import ShardedOptimizer
    from zeroimpl.integrations.collectives import CollectiveCounter, summarize

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    groups = muon_groups(model)
    predicted = estimate_memory(groups, world_size, 2, rank=rank, optimizer_kwargs={"lr": 3e-4})
    optimizer = ShardedOptimizer(groups, torch.optim.AdamW, stage=2, lr=3e-4)
    counter = CollectiveCounter().install()
    ids = torch.randint(0, 50257, (1, 64), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # the second step is the steady state (state exists)
        counter.take()
        model(input_ids=ids, labels=ids).loss.backward()
        held = optimizer.memory_report().device.optimizer_state
        optimizer.step()
        optimizer.zero_grad()
    summary = summarize(counter.take())
    counter.uninstall()
    return {"psi": optimizer.layout.numel, "reduce_scatter": summary["reduce_scatter_single"][1],
            "all_gather": summary["all_gather_single"][1], "state": optimizer.memory_report().device.optimizer_state,
            "held_before_step": held, "predicted": predicted.device.optimizer_state}


def measured_rows() -> list[str]:
    rows = []
    for world_size in (2, 4):
        by_rank = run_distributed(world_size, _measure, timeout=1800, env={"ZEROIMPL_COLLECTIVES": "native"})
        first = by_rank[0]
        states = [r["state"] for r in by_rank]
        exact = all(r["state"] == r["predicted"] for r in by_rank)
        rows.append(f"| {world_size} | {first['psi'] / 1e6:.2f}M | {first['reduce_scatter'] / first['psi']:.4f} | "
                    f"{first['all_gather'] / first['psi']:.4f} | "
                    f"{', '.join(f'{s / 2**20:.1f}' for s in states)} | "
                    f"{max(states) / (sum(states) / world_size):.3f} | {'yes' if exact else 'NO'} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", action="store_true", help="the layout part only")
    args = parser.parse_args()
    lines = ["# Whole-parameter shards: Muon on the hidden matrices, AdamW on the rest", "",
             f"Measured on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, by "
             f"`python benchmarks/whole_parameter.py{' --layout' if args.layout else ''}`. Default buckets "
             "(2**22 elements).", "",
             "## Layout (meta-device models)", "",
             "Padding: elements the reduce-scatter and all-gather carry beyond Ψ, per step. Newton-Schulz "
             "max/mean: the busiest rank's `m*n*min(m,n)` over the mean, whole-parameter shards vs the same "
             "matrices cut flat (each rank holding part of a matrix runs all of its Newton-Schulz, as DeepSpeed's "
             "ZeRO Muon). State max/mean: the fullest rank's Muon + AdamW state over (total state)/N "
             "(`estimate_memory`).", "",
             "| model | Ψ | N | padding | Newton-Schulz max/mean, whole | ... flat | state max/mean |",
             "| --- | --- | --- | --- | --- | --- | --- |", *layout_rows()]
    if not args.layout:
        lines += ["", "## Measured: GPT-2 124M, stage 2, gloo, one steady-state step", "",
                  "Elements per step over Ψ, counted with the collective counter; optimizer state per rank from "
                  "`memory_report()` (MiB) and whether it equals `estimate_memory(..., rank=r)` on every rank.", "",
                  "| N | Ψ | reduce-scatter / Ψ | all-gather / Ψ | state per rank (MiB) | state max/mean | "
                  "estimate exact |", "| --- | --- | --- | --- | --- | --- | --- |", *measured_rows()]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
