"""Compare zeroimpl with DDP, PyTorch ZeRO, FairScale and DeepSpeed on a Hugging Face model, side by side.

    python examples/memory_comparison.py [--model gpt2|llama|bert|t5] [--size tiny|small|base|large]
                                         [--world-size 2] [--steps 6] [--accum 1] [--only NAME ...]
                                         [--out runs/comparison]

Each implementation trains the same model (same initial weights), on the same data, with the same AdamW
settings, in its own set of processes (gloo on CPU; NCCL with --device cuda). At the end it prints a table
(memory by kind, peak, step time, deviation from DDP and a verdict), and writes comparison.md, .csv, .json
and a .png chart to --out. Peers that are not installed are skipped with the command that installs them.
The default (GPT-2 "base", 29.5M parameters, 2 ranks, 11 rows) takes about 5 minutes on 2 CPU cores.
"""

import argparse
import sys

from integrations.adapters import TrainSettings, all_implementations
from integrations.comparison.compare import compare
from integrations.comparison.harness import Workload
from integrations.models import FAMILIES, SIZES


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=FAMILIES)
    parser.add_argument("--size", default="base", choices=tuple(SIZES))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (the first is not timed)")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME",
                        help="run only implementations whose name contains one of these (DDP always runs)")
    parser.add_argument("--out", default="runs/comparison", help="folder for the table, CSV, JSON and chart")
    return parser.parse_args()


def main():
    args = parse_args()
    implementations = [i for i in all_implementations()
                       if args.only is None or i.stage == 0 or any(n.lower() in i.name.lower() for n in args.only)]
    settings = TrainSettings(lr=args.lr, accum=args.accum, micro_batch_size=args.micro_batch_size)
    workload = Workload(args.model, args.size, args.world_size, args.steps, settings=settings, device=args.device)
    compare(workload, args.out, implementations, command="python " + " ".join(sys.argv))
    print(f"\nwrote {args.out}/comparison.md, .csv, .json and .png")


if __name__ == "__main__":
    main()
