"""Do the 8-bit collectives train as well? Hundreds of steps of a byte-level GPT-2 on real text, each way.

At 2 ranks on gloo, zeroimpl stage 2 + AdamW (lr 1e-3, clip 1.0) trains a GPT-2 (4 layers, hidden 256, 4 heads,
256 byte tokens, context 128) on the bytes of the Python standard library's own source files (local: no
download; the same files on every machine with the same Python), each rank on its own batches of 8 sequences.
Once exact, once with the 8-bit parameter all-gather (``quantize_param_gather``), once with the 8-bit gradient
reduce-scatter (``quantize_grad_reduce``), once with both, from the same initialisation and batches. Reported:
the mean loss over the last 50 steps of each run and its ratio to the exact run's, the largest gap between
each curve and the exact one (each smoothed over 20 steps), and the curves plotted.

    python benchmarks/quantized_loss.py                     # 400 steps per run (about 10 minutes on 2 cores)
    python benchmarks/quantized_loss.py --workload link --steps 300   # the link-bound model (about 10 minutes)

``--workload link`` trains the model of benchmarks/network.py's link-bound workload instead (GPT-2 with one
layer, hidden 512 and a tied 65536-word embedding: ``zeroimpl.integrations.models.SIZES["link"]``) on the same
bytes read two at a time as 65536 tokens, 4 sequences of 16 tokens per rank and step, flat and hybrid: exact,
with both 8-bit collectives, hybrid over a (2 replicas x 1 shard) mesh exact, and with the all-reduce across
the replicas in 8 bits (``quantize_grad_reduce="replicas"``). Each 8-bit run is held against its exact twin.
It writes quantized_loss_link.md and .png.
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zeroimpl.integrations.launch import run_distributed  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
CONTEXT, BATCH, TAIL, SMOOTH = 128, 8, 50, 20
MODES = {  # label -> ShardedOptimizer options
    "exact": {},
    "8-bit all-gather": {"quantize_param_gather": True},
    "8-bit reduce-scatter": {"quantize_grad_reduce": True},
    "both 8-bit": {"quantize_param_gather": True, "quantize_grad_reduce": True},
}
LINK_MODES = {  # label -> (ShardedOptimizer options, hybrid over 2 replicas, its exact twin)
    "flat, exact": ({}, False, None),
    "flat, both 8-bit": ({"quantize_param_gather": True, "quantize_grad_reduce": True}, False, "flat, exact"),
    "hybrid, exact": ({}, True, None),
    "hybrid, 8-bit across replicas": ({"quantize_grad_reduce": "replicas"}, True, "hybrid, exact"),
}
LINK_CONTEXT, LINK_BATCH = 16, 4


def corpus() -> torch.Tensor:
    """The bytes of the standard library's top-level ``*.py`` files, in name order (uint8, 1-D)."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    return torch.frombuffer(bytearray(b"".join(open(path, "rb").read() for path in files)), dtype=torch.uint8)


def _losses(rank: int, world_size: int, steps: int, options: dict, workload: str = "bytes",
            hybrid: bool = False) -> list[float]:
    import transformers

    from zeroimpl import ShardedOptimizer

    text = corpus()
    torch.manual_seed(0)
    if workload == "link":
        from zeroimpl.integrations.models import build_model

        model, context, batch = build_model("gpt2", "link"), LINK_CONTEXT, LINK_BATCH
        text = text[:text.numel() // 2 * 2].view(-1, 2).long()
        text = text[:, 0] * 256 + text[:, 1]  # two bytes a token: a vocabulary of 65536
    else:
        model, context, batch = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_positions=CONTEXT, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)), \
            CONTEXT, BATCH
    mesh = None
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3, weight_decay=0.01,
                                 device_mesh=mesh, **options)
    losses = []
    for step in range(steps):
        starts = torch.randint(0, text.numel() - context, (batch,),
                               generator=torch.Generator().manual_seed(step * world_size + rank))
        ids = torch.stack([text[s:s + context] for s in starts.tolist()]).long()
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.backward(loss)
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        average = loss.detach().clone()
        torch.distributed.all_reduce(average)
        losses.append(average.item() / world_size)
    optimizer.finish_param_gathers()
    return losses


def smoothed(values: list[float]) -> list[float]:
    return [sum(values[max(0, i - SMOOTH + 1):i + 1]) / len(values[max(0, i - SMOOTH + 1):i + 1])
            for i in range(len(values))]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workload", choices=["bytes", "link"], default="bytes")
    parser.add_argument("--modes", nargs="+", choices=list(MODES)[1:], default=list(MODES)[1:],
                        help="which quantized runs to compare with the exact one (default: all; bytes only)")
    args = parser.parse_args()
    if args.workload == "link":
        curves = {label: run_distributed(2, _losses, args.steps, options, "link", hybrid, timeout=3600)[0]
                  for label, (options, hybrid, _) in LINK_MODES.items()}
        twins = {label: twin or label for label, (_, _, twin) in LINK_MODES.items()}
    else:
        curves = {label: run_distributed(2, _losses, args.steps, MODES[label], timeout=3600)[0]
                  for label in ["exact", *args.modes]}
        twins = dict.fromkeys(curves, "exact")
    tails = {label: sum(curve[-TAIL:]) / TAIL for label, curve in curves.items()}
    gaps = {label: max(abs(a - b) / a for a, b in zip(smoothed(curves[twins[label]]), smoothed(curve)))
            for label, curve in curves.items()}
    figure, axes = plt.subplots(figsize=(7, 4))
    for label, curve in curves.items():
        axes.plot(smoothed(curve), label=label)
    axes.set_xlabel("step")
    axes.set_ylabel(f"loss (mean of the 2 ranks, smoothed over {SMOOTH} steps)")
    stem = "quantized_loss" if args.workload == "bytes" else "quantized_loss_link"
    if args.workload == "link":
        axes.set_title("GPT-2 link-bound (1 x 512, 65536 tokens), 2 ranks, zeroimpl stage 2")
        described = (f"the link-bound GPT-2 of benchmarks/network.py (1 layer, hidden 512, a tied 65536-word "
                     f"embedding) on the Python {platform.python_version()} standard library's source "
                     f"({corpus().numel() / 1e6:.1f} MB) read two bytes a token, zeroimpl stage 2 + AdamW, each rank "
                     f"{LINK_BATCH} sequences of {LINK_CONTEXT} tokens per step; hybrid: a (2 replicas x 1 shard) "
                     "mesh. Each run is held against its exact twin (`vs exact`)")
    else:
        axes.set_title("GPT-2 4x256, byte-level, 2 ranks, zeroimpl stage 2")
        described = (f"a byte-level GPT-2 (4 layers, hidden 256) on the Python {platform.python_version()} standard "
                     f"library's source ({corpus().numel() / 1e6:.1f} MB), zeroimpl stage 2 + AdamW, each rank "
                     f"{BATCH} sequences of {CONTEXT} bytes per step")
    axes.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(RESULTS, f"{stem}.png"), dpi=100)
    command = f"python benchmarks/quantized_loss.py --steps {args.steps}" + (
        " --workload link" if args.workload == "link" else "")
    text = "\n".join([
        "# Training with 8-bit collectives (`quantize_param_gather`, `quantize_grad_reduce`)", "",
        f"Measured on {platform.machine()}, torch {torch.__version__}, gloo, 2 ranks, by `{command}`: {described}. "
        f"Plot: [{stem}.png]({stem}.png).", "",
        f"| collectives | mean loss, last {TAIL} steps | vs exact | largest gap to exact, smoothed over {SMOOTH} "
        "steps |", "| --- | --- | --- | --- |",
        *(f"| {label} | {tails[label]:.4f} | {tails[label] / tails[twins[label]]:.4f} | {gaps[label]:.4f} |"
          for label in curves), ""])
    with open(os.path.join(RESULTS, f"{stem}.md"), "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
