"""Does ``quantize_param_gather`` train as well? Hundreds of steps of a byte-level GPT-2 on real text, both ways.

At 2 ranks on gloo, zeroimpl stage 2 + AdamW (lr 1e-3, clip 1.0) trains a GPT-2 (4 layers, hidden 256, 4 heads,
256 byte tokens, context 128) on the bytes of the Python standard library's own source files (local: no
download; the same files on every machine with the same Python), each rank on its own batches of 8 sequences.
Once with the exact all-gather, once with the int8 one, from the same initialisation and batches. Reported:
the mean loss over the last 50 steps of each run and their relative difference, the largest gap between the
two curves (each smoothed over 20 steps), and the curves plotted.

    python benchmarks/quantized_loss.py                     # 400 steps per run (about 5 minutes on 2 cores)
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


def corpus() -> torch.Tensor:
    """The bytes of the standard library's top-level ``*.py`` files, in name order (uint8, 1-D)."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    return torch.frombuffer(bytearray(b"".join(open(path, "rb").read() for path in files)), dtype=torch.uint8)


def _losses(rank: int, world_size: int, steps: int, quantize: bool) -> list[float]:
    import transformers

    from zeroimpl import ShardedOptimizer

    text = corpus()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=CONTEXT, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0))
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3, weight_decay=0.01,
                                 quantize_param_gather=quantize)
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
    args = parser.parse_args()
    curves = {quantize: run_distributed(2, _losses, args.steps, quantize, timeout=3600)[0]
              for quantize in (False, True)}
    exact, int8 = (sum(curves[q][-TAIL:]) / TAIL for q in (False, True))
    gap = max(abs(a - b) / a for a, b in zip(smoothed(curves[False]), smoothed(curves[True])))
    figure, axes = plt.subplots(figsize=(7, 4))
    for quantize, label in ((False, "exact all-gather"), (True, "int8 all-gather")):
        axes.plot(smoothed(curves[quantize]), label=label)
    axes.set_xlabel("step")
    axes.set_ylabel(f"loss (mean of the 2 ranks, smoothed over {SMOOTH} steps)")
    axes.set_title("GPT-2 4x256, byte-level, 2 ranks, zeroimpl stage 2")
    axes.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(RESULTS, "quantized_loss.png"), dpi=100)
    text = "\n".join([
        "# Training with the parameter all-gather in int8 (`quantize_param_gather`)", "",
        f"Measured on {platform.machine()}, torch {torch.__version__}, gloo, 2 ranks, by `python "
        f"benchmarks/quantized_loss.py --steps {args.steps}`: a byte-level GPT-2 (4 layers, hidden 256) on the "
        f"Python {platform.python_version()} standard library's source ({corpus().numel() / 1e6:.1f} MB), "
        f"zeroimpl stage 2 + AdamW, each rank 8 sequences of {CONTEXT} bytes per step. Plot: "
        "[quantized_loss.png](quantized_loss.png).", "",
        f"| all-gather | mean loss, last {TAIL} steps | vs exact |", "| --- | --- | --- |",
        f"| exact | {exact:.4f} | 1.0000 |", f"| int8 | {int8:.4f} | {int8 / exact:.4f} |", "",
        f"Largest gap between the curves smoothed over {SMOOTH} steps: {gap:.4f} of the exact run's loss.", ""])
    with open(os.path.join(RESULTS, "quantized_loss.md"), "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
