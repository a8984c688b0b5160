"""``zeroimpl-compare``: zeroimpl beside DDP, PyTorch ZeRO, FairScale and DeepSpeed on one Hugging Face model.

    zeroimpl-compare [--model gpt2|llama|bert|t5|DIRECTORY] [--size tiny|small|base|large]
                     [--world-size 2] [--steps 6] [--accum 1] [--optimizer adamw|muon|adamw8bit]
                     [--max-grad-norm 1.0] [--only NAME ...]
                     [--out runs/comparison]
    zeroimpl-compare --build-deepspeed-ops

Each implementation trains the same model (same initial weights), on the same data, with the same AdamW
settings (or, with --optimizer muon, torch.optim.Muon on the hidden matrices and AdamW on the rest; with
adamw8bit, bitsandbytes' AdamW8bit), in its
own set of processes (gloo on CPU; NCCL with --device cuda). At the end it prints a table
(memory by kind, peak, step time, deviation from DDP and a verdict), and writes comparison.md, .csv, .json
and a .png chart to --out. Peers that are not installed are skipped with the command that installs them.
The exit status is 1 when a run failed or deviates from DDP beyond the tolerance (skipped peers are fine).
The default (GPT-2 "base", 29.5M parameters, 2 ranks, 11 rows) takes about 5 minutes on 2 CPU cores.
--model may name a local model directory (saved with save_pretrained, or a config.json alone).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import sys
from typing import Optional, Sequence

from ..models import FAMILIES, SIZES, is_directory_model


def model_name(value: str) -> str:
    """``--model``: a built-in family, or a directory holding a Hugging Face ``config.json``."""
    if value in FAMILIES or is_directory_model(value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither one of {', '.join(FAMILIES)} nor a directory with a "
                                     "config.json (save one with model.save_pretrained(DIRECTORY))")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroimpl-compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", type=model_name,
                        help=f"one of {', '.join(FAMILIES)}, or a local model directory (default: gpt2)")
    parser.add_argument("--size", default="base", choices=tuple(SIZES), help="size of a built-in family (default: base)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (the first is not timed)")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "muon", "adamw8bit"],
                        help="muon: torch.optim.Muon on the hidden matrices, AdamW on the rest; adamw8bit: "
                        "bitsandbytes' AdamW8bit everywhere (pip install 'zeroimpl[lowbit]') (default: adamw)")
    parser.add_argument("--muon-lr", type=float, default=0.02)
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="global 2-norm clipping of every implementation; 0: no clipping (default: 1.0)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="bf16: zeroimpl and DeepSpeed train bf16 parameters with fp32 master shards, the "
                        "others the fp32 model under torch.autocast (default: fp32)")
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME",
                        help="run only implementations whose name contains one of these (DDP always runs)")
    parser.add_argument("--out", default="runs/comparison", help="folder for the table, CSV, JSON and chart")
    parser.add_argument("--build-deepspeed-ops", action="store_true",
                        help="only build the ops DeepSpeed's CPU runs load (CPU Adam, shared-memory collectives), "
                        "which its first run would otherwise build (about 1.5 min on 2 cores), and exit")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parser().parse_args(argv)
    if args.build_deepspeed_ops:
        from ..adapters.deepspeed_zero import DeepSpeed, build_cpu_ops

        missing = DeepSpeed(stage=2).unavailable()
        if missing:
            parser().error(f"--build-deepspeed-ops needs DeepSpeed: {missing}")

        print(f"DeepSpeed's CPU ops are built: {', '.join(build_cpu_ops())}")
        return
    if args.optimizer == "adamw8bit" and importlib.util.find_spec("bitsandbytes") is None:
        parser().error("--optimizer adamw8bit needs bitsandbytes: pip install 'zeroimpl[lowbit]'")
    from tqdm import tqdm

    from ..adapters import TrainSettings, all_implementations
    from .compare import compare
    from .harness import Workload

    try:
        implementations = all_implementations(args.only)
    except ValueError as error:  # --only names no implementation
        parser().error(str(error))
    settings = TrainSettings(lr=args.lr, accum=args.accum, micro_batch_size=args.micro_batch_size,
                             optimizer=args.optimizer, muon_lr=args.muon_lr, precision=args.precision,
                             max_grad_norm=args.max_grad_norm or None)
    workload = Workload(args.model, args.size, args.world_size, args.steps, settings=settings, device=args.device)
    command = "zeroimpl-compare " + shlex.join(sys.argv[1:] if argv is None else argv)
    with tqdm(total=len(implementations), unit="run", desc="comparison") as bar:
        def progress(message: str) -> None:
            """The harness's lines as runs start and end ("[i/n] NAME: outcome" advances the bar)."""
            bar.write(message)
            if re.match(r"\[\d+/\d+\] .+: ", message):
                bar.update(1)
        rows, _ = compare(workload, args.out, implementations, progress=progress, command=command)
    print(f"\nwrote {args.out}/comparison.md, .csv, .json and .png")
    bad = [f"{row.implementation}: {row.outcome if row.outcome.startswith('failed') else row.verdict}"
           for row in rows if row.outcome.startswith("failed") or row.verdict == "DEVIATES"]
    if bad:
        sys.exit("not every implementation matched DDP:\n  " + "\n  ".join(bad))


if __name__ == "__main__":
    main()
