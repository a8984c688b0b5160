"""zeroimpl against DDP, PyTorch ZeRO, FairScale and DeepSpeed: speed, memory and communication, with targets.

    python benchmarks/peers.py [--quick] [--out benchmarks/results/peers]

Reuses the comparison harness (zeroimpl/integrations/comparison): every implementation trains the same Hugging Face
GPT-2 with the same AdamW settings in its own fresh processes (gloo on CPU, NCCL with --device cuda).

1. Speed and memory, at world sizes 1, 2 and 4: median step time (forward + backward + step, after
   warm-up) and tokens/s as ratios to DDP measured in the same run, model-state bytes and peak memory per
   rank. One table and one chart per world size.
   Memory across model sizes: model-state bytes and peak memory per rank for GPT-2 small, base and large
   (1.1M, 29.5M, 110M parameters) at world size 2, in one table and one chart (the base row is the
   world-size-2 run above).
   Peak memory is the peak resident set past start-up, which on CPU also holds what glibc keeps of freed
   blocks; a second pass at world size 2 fixes glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_=65536), so
   that freed blocks go back to the OS and the peak follows the live bytes (slower: every large allocation
   faults its pages in; its step times are not used).
2. Communication per optimizer step, with and without gradient accumulation: every collective each
   implementation issues (DDP's C++ bucket all-reduces routed through its default comm hook so that they
   can be counted), in elements of the full tensor, and the volume in multiples of Ψ (trainable
   parameters) as the ZeRO paper counts it: an all-reduce moves 2x its size (a reduce-scatter and an
   all-gather), every other collective 1x.
3. The targets, each marked met or missed and by how much (the offload host step has its own benchmark,
   benchmarks/host_step.py).
4. Muon: torch.optim.Muon on the hidden matrices and AdamW on the rest (``--optimizer muon`` of the
   comparison), world size 2: step time, memory and the verdict against DDP + torch Muon + torch AdamW, for
   zeroimpl and DeepSpeed's own Muon (PyTorch ZeRO and FairScale take one optimizer class: skipped).
   ``--muon`` runs this section alone and writes ``muon.md`` (about 4 minutes for GPT-2 base on 2 cores).
5. 8-bit AdamW: bitsandbytes' AdamW8bit in every row (``--optimizer adamw8bit``), world size 2, against
   DDP + AdamW8bit. ``--lowbit`` runs it alone and writes ``lowbit.md``; it is not part of the full run.

The full run (GPT-2 base, 29.5M parameters; the size sweep adds GPT-2 small and large) took 25 minutes
on 2 CPU cores (the committed run); --quick (GPT-2 small, sizes tiny and small, fewer rows) about 6 minutes. With 2
cores, world size 4 runs 4 ranks on 2 cores: its times measure contention as much as the implementations.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from typing import Optional

from zeroimpl.integrations.adapters import TrainSettings, all_implementations
from zeroimpl.integrations.comparison.compare import environment, predicted_model_state
from zeroimpl.integrations.comparison.harness import Workload, run_comparison
from zeroimpl.integrations.comparison.report import MIB, Row, build_rows, markdown_table, write_chart
from zeroimpl.integrations.comparison.verdict import judge
from zeroimpl.integrations.models import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_TIME_VS_DDP = 0.95
STEP_TIME_VS_DEEPSPEED_2 = 0.75
# in multiples of the full tensor at world size 2: an all-reduce is a reduce-scatter plus an all-gather; a
# point-to-point send of half a tensor (zeroimpl's pairwise exchanges on gloo) is as much traffic as a ring
# reduce-scatter or all-gather of the whole, and each transfer counts once, at its sender
VOLUME_WEIGHT = {"all_reduce": 2, "all_reduce_coalesced": 2, "isend": 2, "irecv": 0}  # other collectives: 1
SIZE_SWEEP = {"full": ("small", "base", "large"), "quick": ("tiny", "small")}  # at world size 2
QUICK_ROWS = ("DDP", "PyTorch ZeRO", "FairScale OSS+SDP", "DeepSpeed ZeRO-2", "zeroimpl stage 1", "zeroimpl stage 2")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="GPT-2 small, fewer rows and steps (~5 minutes)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--muon", action="store_true", help="only the Muon section: writes muon.md and muon.png")
    parser.add_argument("--lowbit", action="store_true",
                        help="only the 8-bit AdamW section (bitsandbytes): writes lowbit.md and lowbit.png")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "peers"))
    return parser.parse_args()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- speed and memory -----------------------------------------------------------------------------------
def speed_and_memory(workload: Workload, implementations, chart: str) -> list[Row]:
    with tempfile.TemporaryDirectory() as workdir:
        results = run_comparison(implementations, workload, workdir, progress=log)
        reference = next(r for r in results if r.stage == 0)
        if not reference.ranks:
            raise RuntimeError(f"DDP did not run at world size {workload.world_size}: {reference.failed}")
        verdicts = {r.implementation: v for r in results if (v := judge(r, reference, workload.settings))}
    predicted = {i.name: p for i in implementations if (p := predicted_model_state(i, workload)) is not None}
    rows = build_rows(results, verdicts, predicted)
    write_chart(rows, f"{workload.family} {workload.size}, world size {workload.world_size}", chart)
    return rows


# -- memory across model sizes --------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def parameter_count(size: str, family: str = "gpt2") -> int:
    """Trainable parameters (Ψ) of the harness's model of that size."""
    return sum(p.numel() for p in build_model(family, size).parameters() if p.requires_grad)


def sizes_markdown(rows_by_size: dict[str, list[Row]]) -> str:
    """Per implementation and size: model states and peak per rank (MiB), and model-state bytes per parameter."""
    sizes = list(rows_by_size)
    psi = {size: parameter_count(size) for size in sizes}
    header = "| implementation | " + " | ".join(f"{size} ({psi[size] / 1e6:.1f}M): states / peak MiB, B/param"
                                              for size in sizes) + " |"
    lines = [header, "|---|" + "---|" * len(sizes)]
    for name in [r.implementation for r in rows_by_size[sizes[0]]]:
        cells = []
        for size in sizes:
            row = _row(rows_by_size[size], name)
            if row is None:
                cells.append("-")
                continue
            states = row.model_state_bytes["total"]
            cells.append(f"{states / MIB:.1f} / {row.peak_bytes / MIB:.0f}, {states / psi[size]:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_sizes_chart(rows_by_size: dict[str, list[Row]], path: str) -> None:
    """Model states and peak per rank against the parameter count, one line per implementation (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(rows_by_size)
    psi = [parameter_count(size) for size in sizes]
    figure, panels = plt.subplots(1, 2, figsize=(15, 6), sharex=True)
    names = [r.implementation for r in rows_by_size[sizes[0]]]
    for index, name in enumerate(names):
        points = [(p, row) for p, size in zip(psi, sizes) if (row := _row(rows_by_size[size], name)) is not None]
        if not points:
            continue
        style = {"marker": "o", "linestyle": "-" if name.startswith("zeroimpl") else "--",
                 "color": plt.cm.tab20(index % 20), "label": name}
        panels[0].plot([p for p, _ in points], [r.model_state_bytes["total"] / MIB for _, r in points], **style)
        panels[1].plot([p for p, _ in points], [r.peak_bytes / MIB for _, r in points], **style)
    for panel, title in zip(panels, ("model states per rank (MiB)", "peak memory per rank past start-up (MiB)")):
        panel.set_xscale("log")
        panel.set_yscale("log")
        panel.set_xlabel("trainable parameters (GPT-2 " + ", ".join(sizes) + ")")
        panel.set_title(title)
        panel.grid(True, which="both", alpha=0.3)
    panels[1].legend(fontsize=8, loc="upper left")
    figure.suptitle("Memory across model sizes, world size 2, fp32, AdamW")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# -- communication --------------------------------------------------------------------------------------
def communication(base: Workload, implementations, accum: int) -> dict[str, dict]:
    """Per implementation: collectives per optimizer step on rank 0 (name -> [calls, elements]) and the total
    in multiples of Ψ, from the last timed step."""
    workload = Workload(base.family, "small", 2, steps=3, warmup_steps=1, device=base.device,
                        settings=TrainSettings(accum=accum), count_collectives=True)
    psi = parameter_count(workload.size, workload.family)
    with tempfile.TemporaryDirectory() as workdir:
        results = run_comparison(implementations, workload, workdir, progress=log)
    table = {"psi": psi}
    for result in results:
        if not result.ranks:
            table[result.implementation] = {"outcome": result.skipped or result.failed}
            continue
        per_name: dict[str, list[int]] = {}
        for name, numel, *_ in result.ranks[0].collectives[-1]:
            calls, elements = per_name.get(name, [0, 0])
            per_name[name] = [calls + 1, elements + numel]
        volume = sum(VOLUME_WEIGHT.get(name, 1) * elements for name, (_, elements) in per_name.items())
        table[result.implementation] = {"collectives": per_name, "volume_over_psi": volume / psi}
    return table


def communication_markdown(tables: dict[int, dict]) -> str:
    lines = ["| implementation | accumulation | collectives per optimizer step (calls x, elements) | volume / Ψ |",
             "|---|---|---|---|"]
    for accum, table in tables.items():
        for name, entry in table.items():
            if name == "psi":
                continue
            if "collectives" not in entry:
                lines.append(f"| {name} | {accum} | {entry['outcome']} | - |")
                continue
            calls = ", ".join(f"{op} {count}x {elements:,}" for op, (count, elements) in entry["collectives"].items())
            lines.append(f"| {name} | {accum} | {calls} | {entry['volume_over_psi']:.3f} |")
    return "\n".join(lines)


# -- targets --------------------------------------------------------------------------------------------
def _row(rows: list[Row], name: str):
    return next((r for r in rows if r.implementation == name and r.step_ms is not None), None)


def targets(rows_by_world: dict[int, list[Row]], comm: dict[int, dict],
            live_rows: Optional[list[Row]], other_sizes: dict[str, list[Row]]) -> list[str]:
    """One line per target: met or MISSED, with the measured figure. ``other_sizes``: label -> rows of the
    model-size sweep's runs beyond the main size."""
    lines = []
    peers_at_stage = {1: ("PyTorch ZeRO", "DeepSpeed ZeRO-1"), 2: ("FairScale OSS+SDP", "DeepSpeed ZeRO-2")}
    memory_passes = [(f"world size {w}", rows) for w, rows in rows_by_world.items()]
    if live_rows:
        memory_passes.append(("world size 2, live memory (fixed mmap threshold)", live_rows))
    memory_passes += list(other_sizes.items())
    for label, rows in memory_passes:
        for stage in (1, 2):
            for offload in ("", " + offload"):
                ours_row = _row(rows, f"zeroimpl stage {stage}{offload}")
                peers = [p for name in peers_at_stage[stage] if (p := _row(rows, name + offload)) is not None]
                if ours_row is None or not peers:
                    continue
                lowest = min(peers, key=lambda r: r.peak_bytes)
                lines.append(_mark(ours_row.peak_bytes < lowest.peak_bytes,
                                   f"{label}, stage {stage}{offload}: peak {ours_row.peak_bytes / MIB:.0f} MiB vs the "
                                   f"lowest peer {lowest.implementation} {lowest.peak_bytes / MIB:.0f} MiB "
                                   f"({(ours_row.peak_bytes - lowest.peak_bytes) / MIB:+.0f} MiB)"))
    for world, rows in rows_by_world.items():
        deepspeed_2 = _row(rows, "DeepSpeed ZeRO-2")
        for stage in (1, 2):
            ours = _row(rows, f"zeroimpl stage {stage}")
            if ours is None:
                continue
            ratio = ours.step_time_vs_ddp
            lines.append(_mark(ratio <= STEP_TIME_VS_DDP, f"world size {world}, stage {stage}: step time "
                               f"{ratio:.2f}x DDP (target <= {STEP_TIME_VS_DDP}x)"))
            if deepspeed_2 is not None:
                versus = ours.step_ms / deepspeed_2.step_ms
                lines.append(_mark(versus <= STEP_TIME_VS_DEEPSPEED_2, f"world size {world}, stage {stage}: step "
                                   f"time {versus:.2f}x DeepSpeed ZeRO-2 (target <= {STEP_TIME_VS_DEEPSPEED_2}x)"))
    for accum, table in comm.items():
        for stage in (1, 2):
            entry = table.get(f"zeroimpl stage {stage}", {})
            if "volume_over_psi" in entry:
                volume = entry["volume_over_psi"]
                lines.append(_mark(volume <= 2.01, f"accumulation {accum}, stage {stage}: {volume:.3f} Ψ per step "
                                   "(target: the 2Ψ minimum, padding and the step check's few elements aside)"))
    return lines


def _mark(met: bool, text: str) -> str:
    return f"- {'met' if met else '**MISSED**'}: {text}"


def muon_section(implementations, size: str, steps: int, device: str, out: str) -> list[str]:
    """Section 4: the comparison with Muon on the hidden matrices, world size 2 (markdown paragraphs)."""
    log(f"Muon: gpt2 {size}, world size 2")
    settings = TrainSettings(optimizer="muon")
    workload = Workload("gpt2", size, 2, steps=steps, warmup_steps=2, settings=settings, device=device)
    rows = speed_and_memory(workload, implementations, os.path.join(out, "muon.png"))
    return [f"## Muon: gpt2 {size}, world size 2, {steps} steps ({steps - 2} timed), micro-batch 4, fp32, clip 1.0",
            f"torch.optim.Muon (lr {settings.muon_lr}, weight decay {settings.weight_decay}) on the hidden matrices, "
            f"AdamW (lr {settings.lr}) on the rest; the reference is DDP + those two torch optimizers. Muon's "
            "tolerance: 0.25 of its lr on parameters, 1e-3 on losses (torch's Muon orthogonalises in bf16: "
            "tests/test_optimizer_kinds_whole_parameter.py). DeepSpeed runs its own Muon "
            "(`\"type\": \"Muon\"`, standard "
            "Newton-Schulz), which picks its matrices itself (2-D parameters whose names have neither \"embed\" "
            "nor \"lm_head\": on GPT-2 also `wte` and `wpe`). Chart: `muon.png`.", markdown_table(rows)]


def lowbit_section(implementations, size: str, steps: int, device: str, out: str) -> list[str]:
    """Section 5: the comparison with bitsandbytes' AdamW8bit everywhere, world size 2 (markdown paragraphs)."""
    log(f"AdamW8bit: gpt2 {size}, world size 2")
    settings = TrainSettings(optimizer="adamw8bit")
    workload = Workload("gpt2", size, 2, steps=steps, warmup_steps=2, settings=settings, device=device)
    rows = speed_and_memory(workload, implementations, os.path.join(out, "lowbit.png"))
    return [f"## 8-bit AdamW: gpt2 {size}, world size 2, {steps} steps ({steps - 2} timed), micro-batch 4, fp32, "
            "clip 1.0",
            f"bitsandbytes' AdamW8bit (lr {settings.lr}) in every row; the reference is DDP + AdamW8bit. zeroimpl "
            "recognises it and cuts its flat shards on quantization blocks, each parameter placed so that its "
            "pieces keep its 8-bit or fp32 choice by size (blocks and the threshold count from a parameter's first "
            "element), so its state per rank is half DDP's; PyTorch ZeRO and FairScale OSS partition whole "
            "parameters. "
            "DeepSpeed has no 8-bit optimizer: it takes AdamW8bit as a client optimizer only with "
            "`zero_allow_untested_optimizer` (and `zero_force_ds_cpu_optimizer: false` with offload), and then "
            "steps its flat fp32 partition as one tensor, so blocks cross parameters: its verdict shows what that "
            "does. FSDP2 (not run here) would hand the optimizer each rank's dim-0 slice of every parameter, so "
            "blocks and the size threshold would follow the mesh. zeroimpl's deviation is clipping's: its global "
            "norm sums the shards' squares in another order than DDP's clip_grad_norm_ (within tolerance with fp32 "
            "AdamW: the main table), and 8-bit state turns such a last-bit difference into a different quantized "
            "value. Without clipping it is bitwise DDP's (`zeroimpl-compare --optimizer adamw8bit "
            "--max-grad-norm 0 --only \"zeroimpl stage 1\" \"zeroimpl stage 2 + offload\"`: both bitwise), as "
            "tests/test_optimizer_kinds_lowbit.py checks at world sizes 2, 3 and 4 on odd sizes. Chart: `lowbit.png`.", markdown_table(rows)]


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    implementations = all_implementations()
    if args.quick:
        implementations = [i for i in implementations if i.name in QUICK_ROWS]
    size, steps = ("small", 5) if args.quick else ("base", 8)
    started = time.monotonic()
    if args.muon or args.lowbit:
        name, title, section = (("muon", "Muon", muon_section) if args.muon else
                                ("lowbit", "8-bit AdamW", lowbit_section))
        env = environment(Workload("gpt2", size, 2, device=args.device))
        command = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
        sections = [f"# zeroimpl against its peers: {title}",
                    f"Machine: {env['device']}; " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "device")
                    + f".  \nCommand: `{command}`.",
                    *section(implementations, size, steps, args.device, args.out)]
        with open(os.path.join(args.out, f"{name}.md"), "w") as handle:
            handle.write("\n\n".join(sections) + "\n")
        log(f"wrote {args.out}/{name}.md and {name}.png")
        return
    rows_by_world = {}
    for world in args.world_sizes:
        log(f"speed and memory: gpt2 {size}, world size {world}")
        workload = Workload("gpt2", size, world, steps=steps, warmup_steps=2, device=args.device)
        rows_by_world[world] = speed_and_memory(workload, implementations,
                                                os.path.join(args.out, f"world-size-{world}.png"))
    rows_by_size = {}
    if 2 in args.world_sizes:
        sizes_out = os.path.join(args.out, "model-sizes")
        os.makedirs(sizes_out, exist_ok=True)
        for sweep_size in SIZE_SWEEP["quick" if args.quick else "full"]:
            if sweep_size == size:
                rows_by_size[sweep_size] = rows_by_world[2]
                continue
            log(f"memory across model sizes: gpt2 {sweep_size}, world size 2")
            rows_by_size[sweep_size] = speed_and_memory(
                Workload("gpt2", sweep_size, 2, steps=3, warmup_steps=1, device=args.device), implementations,
                os.path.join(sizes_out, f"gpt2-{sweep_size}.png"))
        write_sizes_chart(rows_by_size, os.path.join(sizes_out, "memory.png"))
    live_rows = None
    if 2 in args.world_sizes and args.device == "cpu":
        log("live-memory pass: world size 2, MALLOC_MMAP_THRESHOLD_=65536")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the ranks spawned below
        try:
            live_out = os.path.join(args.out, "live-memory")
            os.makedirs(live_out, exist_ok=True)
            live_rows = speed_and_memory(Workload("gpt2", size, 2, steps=4, warmup_steps=1, device=args.device),
                                         implementations, os.path.join(live_out, "world-size-2.png"))
        finally:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
    comm = {}
    for accum in (1, 2):
        log(f"communication: gpt2 small, world size 2, accumulation {accum}")
        comm[accum] = communication(workload, implementations, accum)
    checks = targets(rows_by_world, comm, live_rows,
                     {f"gpt2 {s}, world size 2": rows for s, rows in rows_by_size.items() if s != size})
    env = environment(workload)
    command = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    sections = [f"# zeroimpl against its peers ({'quick' if args.quick else 'full'} run)",
                f"Machine: {env['device']}; " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "device")
                + f".  \nCommand: `{command}` ({(time.monotonic() - started) / 60:.0f} minutes).",
                "## Targets", "\n".join(checks)]
    for world, rows in rows_by_world.items():
        sections += [f"## World size {world}: gpt2 {size}, {steps} steps ({steps - 2} timed), micro-batch 4, "
                     "fp32, AdamW, clip 1.0", "Memory in MiB per rank; `vs DDP`: median step time over DDP's in "
                     f"this run. Chart: `world-size-{world}.png`.", markdown_table(rows),
                     "tokens/s: " + ", ".join(f"{r.implementation} {r.tokens_per_second:,.0f}" for r in rows
                                              if r.tokens_per_second)]
    if rows_by_size:
        sections += ["## Memory across model sizes: world size 2, fp32, AdamW, micro-batch 4",
                     f"Per rank: model states / peak memory past start-up in MiB, and model-state bytes per trainable "
                     f"parameter (DDP with AdamW in fp32: 16). The {size} runs are the world-size-2 table above; the "
                     "others ran 3 steps (the rows' full tables: `model-sizes/gpt2-*.png` and results.json). Chart: "
                     "`model-sizes/memory.png`.", sizes_markdown(rows_by_size)]
    if live_rows:
        sections += [f"## Live memory: world size 2, gpt2 {size}, MALLOC_MMAP_THRESHOLD_=65536",
                     "Freed blocks go back to the OS, so the peak follows the live bytes; step times here include "
                     "the page faults of every large allocation and are not used.", markdown_table(live_rows)]
    if 2 in args.world_sizes:
        sections += muon_section(implementations, size, steps, args.device, args.out)
    sections += ["## Communication per optimizer step (gpt2 small, world size 2, rank 0)",
                 f"Ψ = {comm[1]['psi']:,} trainable parameters. Elements of the full tensor each collective reduces "
                 "or gathers; DDP's bucket all-reduces counted through its default comm hook. Volume: an "
                 "all-reduce counts twice its size (reduce-scatter + all-gather), a point-to-point send (zeroimpl's pairwise "
                 "exchanges on gloo: half a bucket each way) twice the elements sent and a receive not at all, "
                 "other collectives once.",
                 communication_markdown(comm)]
    with open(os.path.join(args.out, "README.md"), "w") as handle:
        handle.write("\n\n".join(sections) + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump({"environment": env, "command": command, "targets": checks, "communication": comm,
                   "rows": {w: [r.__dict__ for r in rows] for w, rows in rows_by_world.items()},
                   "live_memory_rows": [r.__dict__ for r in live_rows or []],
                   "model_size_rows": {s: [r.__dict__ for r in rows] for s, rows in rows_by_size.items()}},
                  handle, indent=1)
    log("\n".join(checks))
    log(f"wrote {args.out}/README.md, results.json and world-size-*.png")


if __name__ == "__main__":
    main()
