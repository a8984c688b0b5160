"""One call that runs the comparison end to end and writes its results (used by examples/ and benchmarks/)."""

from __future__ import annotations

import contextlib
import os
import platform
import tempfile
from typing import Callable, Optional

import torch

from zeroimpl import estimate_memory

from ..adapters import Implementation, Zeroimpl, all_implementations
from ..adapters.zeroimpl_optimizer import sharded_groups
from ..models import build_model, is_directory_model
from .harness import RunResult, Workload, run_comparison
from .report import Row, build_rows, caption, markdown_table, terminal_table, write_chart, write_csv, write_json
from .verdict import judge


def predicted_model_state(implementation: Implementation, workload: Workload) -> Optional[int]:
    """zeroimpl's estimate for its own rows (parameters, gradients, optimizer state, master weights)."""
    if not isinstance(implementation, Zeroimpl):
        return None
    dtype = torch.bfloat16 if workload.settings.precision == "bf16" else torch.float32
    # shapes and dtypes are all it needs (a saved model loads its weights: transformers refuses meta there)
    with contextlib.nullcontext() if is_directory_model(workload.family) else torch.device("meta"):
        model = build_model(workload.family, workload.size, dtype)
    report = estimate_memory(sharded_groups(model, workload.settings), workload.world_size,
                             implementation.stage, offload="cpu" if implementation.offload else None,
                             optimizer_class=workload.settings.adamw_class(),
                             optimizer_kwargs=workload.settings.adamw_kwargs())
    return report.total - report.device.bucket_buffers - report.host.bucket_buffers


def environment(workload: Workload) -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for module in ("transformers", "deepspeed", "fairscale"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = "not installed"
    device = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    if workload.device == "cuda":
        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return {"device": device, **versions}


def compare(workload: Workload, outdir: str, implementations: Optional[list[Implementation]] = None,
            progress: Callable[[str], None] = print, command: Optional[str] = None) -> tuple[list[Row], list[RunResult]]:
    """Run every implementation (default: all) on ``workload``; write ``comparison.{md,csv,json,png}``.

    ``comparison.md`` is written again as each implementation finishes, with the rows so far (judged once DDP,
    the reference, has run), so that a run cut short keeps what ran. ``command``: the command line that
    reproduces the run, recorded in ``comparison.md``."""
    implementations = implementations or all_implementations()
    os.makedirs(outdir, exist_ok=True)
    with contextlib.nullcontext() if is_directory_model(workload.family) else torch.device("meta"):
        parameters = sum(p.numel() for p in build_model(workload.family, workload.size).parameters())
    title = caption(workload, parameters)
    env = environment(workload)
    command_note = f"Machine: {env['device']}; " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "device")
    if command:
        command_note += f".  \nCommand: `{command}`"
    predicted = {i.name: p for i in implementations if (p := predicted_model_state(i, workload)) is not None}

    verdicts = {}  # each run judged once (None: it did not finish), when it and the reference have both finished

    def judged_rows(results: list[RunResult]) -> list[Row]:
        reference = next((r for r in results if r.stage == 0 and r.ranks), None)
        for result in results if reference is not None else ():
            if result.implementation not in verdicts:
                verdicts[result.implementation] = judge(result, reference, workload.settings)
        return build_rows(results, verdicts, predicted)

    def write_markdown(results: list[RunResult]) -> None:
        left = len(implementations) - len(results)
        partial = f"\n\n({left} of {len(implementations)} rows still to run.)" if left else ""
        with open(os.path.join(outdir, "comparison.md"), "w") as handle:
            handle.write(f"{title}\n\n{command_note}\n\n{markdown_table(judged_rows(results))}{partial}\n")

    with tempfile.TemporaryDirectory() as parameters_dir:  # final parameters: large, needed only here
        results = run_comparison(implementations, workload, parameters_dir, progress, finished=write_markdown)
        reference = next((r for r in results if r.stage == 0), None)
        if reference is None or not reference.ranks:
            raise RuntimeError("the reference (DDP) did not run, so nothing can be judged: "
                               + (reference.failed if reference else "include DDP in the implementations"))
        rows = judged_rows(results)
    write_csv(rows, os.path.join(outdir, "comparison.csv"))
    write_json(rows, results, workload, env, os.path.join(outdir, "comparison.json"))
    write_chart(rows, title, os.path.join(outdir, "comparison.png"))
    progress("\n" + terminal_table(rows) + "\n\n" + title)
    return rows, results
