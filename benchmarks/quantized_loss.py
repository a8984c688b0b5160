"""Do the 8-bit collectives train as well? Hundreds of steps of a byte-level GPT-2 on real text, each way.

At 2 ranks on gloo, zeroimpl stage 2 + AdamW (lr 1e-3, clip 1.0) trains a GPT-2 (4 layers, hidden 256, 4 heads,
256 byte tokens, context 128) on the bytes of the Python standard library's own source files (local: no
download; the same files on every machine with the same Python), each rank on its own batches of 8 sequences.
Once exact, once with the 8-bit parameter all-gather (``quantize_param_gather``), once with the 8-bit gradient
reduce-scatter (``quantize_grad_reduce``), once with both, from the same initialisation and batches. Reported:
the mean loss over the last 50 steps of each run and its ratio to the exact run's, the largest gap between
each curve and the exact one (each smoothed over 20 steps), and the curves plotted.

    python benchmarks/quantized_loss.py                     # 400 steps per run (about 10 minutes on 2 cores)
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


def corpus() -> torch.Tensor:
    """The bytes of the standard library's top-level ``*.py`` files, in name order (uint8, 1-D)."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    return torch.frombuffer(bytearray(b"".join(open(path, "rb").read() for path in files)), dtype=torch.uint8)


def _losses(rank: int, world_size: int, steps: int, options: dict) -> list[float]:
    import transformers

    from zeroimpl import ShardedOptimizer

    text = corpus()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=CONTEXT, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0))
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3, weight_decay=0.01,
                                 **options)
    losses = []
    for step in range(steps):
        starts = torch.randint(0, text.numel() - CONTEXT, (BATCH,),
                               generator=torch.Generator().manual_seed(step * world_size + rank))
        ids = torch.stack([text[s:s + CONTEXT] for s in starts.tolist()]).long()
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
    parser.add_argument("--modes", nargs="+", choices=list(MODES)[1:], default=list(MODES)[1:],
                        help="which quantized runs to compare with the exact one (default: all)")
    args = parser.parse_args()
    curves = {label: run_distributed(2, _losses, args.steps, MODES[label], timeout=3600)[0]
              for label in ["exact", *args.modes]}
    tails = {label: sum(curve[-TAIL:]) / TAIL for label, curve in curves.items()}
    gaps = {label: max(abs(a - b) / a for a, b in zip(smoothed(curves["exact"]), smoothed(curve)))
            for label, curve in curves.items()}
    figure, axes = plt.subplots(figsize=(7, 4))
    for label, curve in curves.items():
        axes.plot(smoothed(curve), label=label)
    axes.set_xlabel("step")
    axes.set_ylabel(f"loss (mean of the 2 ranks, smoothed over {SMOOTH} steps)")
    axes.set_title("GPT-2 4x256, byte-level, 2 ranks, zeroimpl stage 2")
    axes.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(RESULTS, "quantized_loss.png"), dpi=100)
    text = "\n".join([
        "# Training with 8-bit collectives (`quantize_param_gather`, `quantize_grad_reduce`)", "",
        f"Measured on {platform.machine()}, torch {torch.__version__}, gloo, 2 ranks, by `python "
        f"benchmarks/quantized_loss.py --steps {args.steps}`: a byte-level GPT-2 (4 layers, hidden 256) on the "
        f"Python {platform.python_version()} standard library's source ({corpus().numel() / 1e6:.1f} MB), "
        f"zeroimpl stage 2 + AdamW, each rank 8 sequences of {CONTEXT} bytes per step. Plot: "
        "[quantized_loss.png](quantized_loss.png).", "",
        f"| collectives | mean loss, last {TAIL} steps | vs exact | largest gap to exact, smoothed over {SMOOTH} "
        "steps |", "| --- | --- | --- | --- |",
        *(f"| {label} | {tails[label]:.4f} | {tails[label] / tails['exact']:.4f} | {gaps[label]:.4f} |"
          for label in curves), ""])
    with open(os.path.join(RESULTS, "quantized_loss.md"), "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
