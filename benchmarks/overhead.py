"""What each implementation adds over the compute on one node: DDP, FairScale, zeroimpl and DeepSpeed against
forward + backward alone (issue 47).

    python benchmarks/overhead.py [--size 55m] [--micro-batch 2] [--steps 8] [--rounds 2]

Every row trains GPT-2 55M (6 layers, hidden 768, vocabulary 16384; :data:`zeroimpl.integrations.models.SIZES`)
on 2 CPU ranks (gloo, OMP_NUM_THREADS=1), 2 x 128 tokens per rank, fp32 AdamW with the comparison's settings,
through the comparison harness (:mod:`zeroimpl.integrations.comparison.harness`), in fresh processes. The first
row, "forward + backward alone", runs the same model and micro-batches with no communication and no optimizer
step: the compute that every implementation must do. Each implementation's overhead is its step time minus
that. Rows run one after the other, ``--rounds`` times in turn, so that a slow drift of the machine hits
every row alike; each row keeps the faster of its rounds' medians.

No clipping (``max_grad_norm=None``): the global norm is a sum whose order differs between a sharded and an
unsharded implementation, which would make the losses differ in their last bits after the first step. Without
it zeroimpl's losses and parameters must equal DDP's bitwise at world size 2, and the table says whether they do.

Writes ``overhead.md`` and ``overhead.json`` to ``--out`` (default benchmarks/results/overhead). The targets
(issue 47): zeroimpl's overhead at most 0.9x DDP's and below FairScale's in the same run. Where the time goes
per phase: ``python benchmarks/step_phases.py --size 55m --micro-batch 2 --world-sizes 2 --out
benchmarks/results/overhead/phases.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

from zeroimpl.integrations.adapters import DDP, DeepSpeed, FairScale, Implementation, TrainSettings, Zeroimpl
from zeroimpl.integrations.adapters.base import Runner
from zeroimpl.integrations.adapters.loop import WrapperLoopRunner
from zeroimpl.integrations.comparison.harness import Workload, run_comparison
from zeroimpl.integrations.comparison.verdict import judge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERHEAD_VS_DDP = 0.9  # zeroimpl's time over the compute, at most this times DDP's


class ComputeRunner(WrapperLoopRunner):
    """Forward and backward on the bare model; no optimizer, no communication, no step (the parameters never
    change)."""

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Nothing to step: this row is the compute alone."""

    def model_state(self) -> dict[str, list[torch.Tensor]]:
        return self.common_state()


class ComputeAlone(Implementation):
    """The compute every row does: not a training method (its ranks never agree on gradients)."""

    name = "forward + backward alone"
    stage = -1

    def build(self, model, settings: TrainSettings, device) -> Runner:
        return ComputeRunner(model, model, None, settings, device)


def rows(only=None) -> list[Implementation]:
    """The compute alone and DDP, then the rows whose name contains one of ``only`` (default: every row)."""
    others = [FairScale(), Zeroimpl(2), DeepSpeed(2)]
    return [ComputeAlone(), DDP()] + [row for row in others if not only or any(n in row.name for n in only)]


def measure(args) -> dict:
    """Run every row ``args.rounds`` times in turn; per row the faster round's median step and its losses."""
    settings = TrainSettings(micro_batch_size=args.micro_batch, max_grad_norm=None)
    workload = Workload("gpt2", args.size, 2, steps=args.steps, warmup_steps=2, settings=settings)
    best: dict = {}
    with tempfile.TemporaryDirectory() as workdir:
        for round_index in range(args.rounds):
            results = run_comparison(rows(args.only), workload, os.path.join(workdir, str(round_index)),
                                     progress=lambda line: print(line, flush=True))
            reference = next(r for r in results if r.implementation == "DDP")
            for result in results:
                if result.failed or result.skipped:
                    raise RuntimeError(f"{result.implementation}: {result.failed or result.skipped}")
                verdict = judge(result, reference, settings) if result.implementation != ComputeAlone.name else None
                seconds = result.median_step_seconds
                row = best.setdefault(result.implementation, {"rounds": []})
                row["rounds"].append(seconds)
                if seconds == min(row["rounds"]):
                    row.update(seconds=seconds, loss=result.ranks[0].losses[-1],
                               max_loss_deviation=verdict.max_loss_deviation if verdict else None,
                               max_parameter_deviation=verdict.max_parameter_deviation if verdict else None)
    return best


def markdown(best: dict, command: str) -> str:
    compute = best[ComputeAlone.name]["seconds"]
    over = {name: row["seconds"] - compute for name, row in best.items()}
    lines = ["# What each implementation adds over the compute, on one node", "",
             "GPT-2 55M (6 layers, hidden 768, vocabulary 16384), 2 ranks on 2 CPU cores (gloo, OMP_NUM_THREADS=1), "
             f"2 x 128 tokens per rank, fp32 AdamW, no clipping, torch {torch.__version__}. Per row the faster of "
             "its rounds' median step times (forward + backward + step); rounds ran in turn.  ",
             f"Command: `{command}`.", "",
             "| implementation | step | over the compute | vs DDP's overhead | rounds | loss / parameter deviation "
             "from DDP |", "|---|---|---|---|---|---|"]
    for name, row in best.items():
        deviation = ("-" if row["max_loss_deviation"] is None else
                     f"{row['max_loss_deviation']:.1e} / {row['max_parameter_deviation']:.1e}")
        ratio = "-" if name == ComputeAlone.name else f"{over[name] / over['DDP']:.2f}x"
        lines.append(f"| {name} | {row['seconds'] * 1e3:.0f} ms | {over[name] * 1e3:.0f} ms | {ratio} | "
                     + ", ".join(f"{s * 1e3:.0f}" for s in row["rounds"]) + f" ms | {deviation} |")
    if "zeroimpl stage 2" not in over:
        return "\n".join(lines) + "\n"
    ours, ddp, fairscale = over["zeroimpl stage 2"], over["DDP"], over.get("FairScale OSS+SDP")
    lines += ["", "Targets:", "",
              f"- zeroimpl's overhead at most {OVERHEAD_VS_DDP}x DDP's: {ours / ddp:.2f}x, "
              + ("met" if ours <= OVERHEAD_VS_DDP * ddp else "missed")]
    if fairscale is not None:
        lines.append(f"- below FairScale's: {ours * 1e3:.0f} ms against {fairscale * 1e3:.0f} ms, "
                     + ("met" if ours < fairscale else "missed"))
    lines += ["- losses and parameters bitwise equal to DDP's: "
              + ("yes" if best["zeroimpl stage 2"]["max_loss_deviation"] == 0
                 and best["zeroimpl stage 2"]["max_parameter_deviation"] == 0 else "no")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="55m")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run, the first two untimed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="besides the compute alone and DDP, only the rows whose name contains one of these")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "overhead"))
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    command = "python benchmarks/overhead.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    best = measure(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overhead.json"), "w") as handle:
        json.dump({"command": command, "rows": best}, handle, indent=1)
    text = markdown(best, command)
    with open(os.path.join(args.out, "overhead.md"), "w") as handle:
        handle.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
