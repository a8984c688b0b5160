"""The comparison's outputs: one row per implementation, as a terminal table, CSV, JSON and a PNG chart."""

from __future__ import annotations

import csv
import json
import textwrap
from dataclasses import asdict, dataclass
from typing import Optional

from ..adapters import MODEL_STATE_KINDS
from ..models import is_directory_model
from .harness import RunResult, Workload
from .verdict import Verdict, tolerances

MIB = 2 ** 20


@dataclass
class Row:
    implementation: str
    stage: int
    offload: bool
    outcome: str  # "ran", "skipped: ...", "failed: ..."
    model_state_bytes: Optional[dict] = None  # by kind, with "total"
    predicted_bytes: Optional[int] = None  # zeroimpl.estimate_memory (parameters, gradients, state, masters)
    peak_bytes: Optional[int] = None
    step_ms: Optional[float] = None
    step_time_vs_ddp: Optional[float] = None
    tokens_per_second: Optional[float] = None
    max_loss_deviation: Optional[float] = None
    max_parameter_deviation: Optional[float] = None
    loss_tolerance: Optional[float] = None
    parameter_tolerance: Optional[float] = None
    verdict: Optional[str] = None


def first_error(failure: str) -> str:
    """The last line of the first rank's own traceback (not a rank that was stopped because another failed)."""
    lines = [line for line in failure.strip().splitlines() if line.strip() and "no result" not in line]
    errors = [line for line in lines if not line.startswith((" ", "Traceback", "rank "))]
    return errors[0] if errors else failure.strip().splitlines()[-1]


def build_rows(results: list[RunResult], verdicts: dict[str, Optional[Verdict]],
               predicted: dict[str, int]) -> list[Row]:
    reference = next((r for r in results if r.stage == 0 and r.ranks), None)
    rows = []
    for result in results:
        outcome = ("skipped: " + result.skipped if result.skipped else
                   "failed: " + first_error(result.failed) if result.failed else "ran")
        row = Row(result.implementation, result.stage, result.offload, outcome)
        if result.ranks:
            row.model_state_bytes = result.model_state
            row.predicted_bytes = predicted.get(result.implementation)
            row.peak_bytes = result.peak_bytes
            row.step_ms = result.median_step_seconds * 1e3
            row.tokens_per_second = result.tokens_per_second
            if reference is not None:
                row.step_time_vs_ddp = result.median_step_seconds / reference.median_step_seconds
        verdict = verdicts.get(result.implementation)
        if verdict is not None:
            row.max_loss_deviation = verdict.max_loss_deviation
            row.max_parameter_deviation = verdict.max_parameter_deviation
            row.loss_tolerance, row.parameter_tolerance = verdict.loss_tolerance, verdict.parameter_tolerance
            row.verdict = verdict.status
        rows.append(row)
    return rows


def _mib(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / MIB:.2f}"


def _sci(value: Optional[float]) -> str:
    return "-" if value is None else "0" if value == 0 else f"{value:.1e}"


TABLE_COLUMNS = ("implementation", "params", "grads", "optim state", "master", "buffers", "model states",
                 "predicted", "peak", "step ms", "vs DDP", "max loss dev", "max param dev", "verdict")


def table_cells(row: Row) -> list[str]:
    if row.model_state_bytes is None:
        return [row.implementation] + ["-"] * (len(TABLE_COLUMNS) - 2) + [row.outcome]
    kinds = row.model_state_bytes
    return [row.implementation, *[_mib(kinds[k]) for k in MODEL_STATE_KINDS], _mib(kinds["total"]),
            _mib(row.predicted_bytes), _mib(row.peak_bytes), f"{row.step_ms:.1f}",
            "-" if row.step_time_vs_ddp is None else f"{row.step_time_vs_ddp:.2f}x",
            _sci(row.max_loss_deviation), _sci(row.max_parameter_deviation), row.verdict or "-"]


def markdown_table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(table_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def terminal_table(rows: list[Row]) -> str:
    cells = [list(TABLE_COLUMNS)] + [table_cells(row) for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(TABLE_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def caption(workload: Workload, parameters: int) -> str:
    settings = workload.settings
    model = (f"{workload.family} ({parameters / 1e6:.2f}M parameters)" if is_directory_model(workload.family)
             else f"{workload.family} ({workload.size}, {parameters / 1e6:.2f}M parameters)")
    if settings.optimizer == "muon":
        optimizer = f"Muon lr {settings.muon_lr} on the hidden matrices, AdamW lr {settings.lr} on the rest"
    else:
        optimizer = f"{settings.adamw_class().__name__} lr {settings.lr}"
    tolerance = tolerances(settings)[2]
    precision = ("bf16 (zeroimpl, DeepSpeed: bf16 parameters, fp32 masters; the others: autocast)"
                 if settings.precision == "bf16" else "fp32")
    return (f"{model}, world size "
            f"{workload.world_size}, {workload.device}, {precision}, {optimizer}, {workload.steps} steps "
            f"x {settings.accum} micro-batches of {settings.micro_batch_size}, clip {settings.max_grad_norm}. "
            "Memory in MiB per rank (largest rank); model states at the larger of after-backward and "
            "after-step; peak past start-up; step time median after warm-up; deviations from DDP "
            f"(tolerance: {tolerance}).")


def write_csv(rows: list[Row], path: str) -> None:
    fields = ["implementation", "stage", "offload", "outcome", *[f"{k}_bytes" for k in MODEL_STATE_KINDS],
              "model_state_bytes", "predicted_bytes", "peak_bytes", "step_ms", "step_time_vs_ddp",
              "tokens_per_second", "max_loss_deviation", "max_parameter_deviation", "loss_tolerance",
              "parameter_tolerance", "verdict"]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            record = {k: v for k, v in asdict(row).items() if k != "model_state_bytes"}
            kinds = row.model_state_bytes or {}
            record.update({f"{k}_bytes": kinds.get(k) for k in MODEL_STATE_KINDS})
            record["model_state_bytes"] = kinds.get("total")
            writer.writerow(record)


def write_json(rows: list[Row], results: list[RunResult], workload: Workload, environment: dict, path: str) -> None:
    runs = {r.implementation: [asdict(rank) for rank in r.ranks] for r in results}
    with open(path, "w") as handle:
        json.dump({"workload": asdict(workload), "environment": environment,
                   "rows": [asdict(row) for row in rows], "per_rank": runs}, handle, indent=1)


def write_chart(rows: list[Row], title: str, path: str) -> None:
    """Three panels per implementation: model-state memory by kind (stacked) with the peak, step time,
    and the deviation from DDP against the tolerance (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [row for row in rows if row.model_state_bytes is not None]
    names = [row.implementation for row in ran]
    positions = range(len(ran))
    figure, (memory, speed, deviation) = plt.subplots(1, 3, figsize=(18, 0.5 * len(ran) + 3.5), sharey=True)
    left = [0.0] * len(ran)
    for kind in MODEL_STATE_KINDS:
        values = [row.model_state_bytes[kind] / MIB for row in ran]
        memory.barh(positions, values, left=left, label=kind.replace("_", " "))
        left = [a + b for a, b in zip(left, values)]
    memory.scatter([row.peak_bytes / MIB for row in ran], positions, marker="|", s=300, color="black",
                   label="peak (past start-up)", zorder=3)
    memory.set_xlabel("MiB per rank")
    memory.set_title("memory")
    memory.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    speed.barh(positions, [row.step_ms for row in ran], color="tab:gray")
    speed.set_xlabel("median step time, ms")
    speed.set_title("speed")
    judged = [row for row in ran if row.max_parameter_deviation is not None]
    floor = 1e-12  # bitwise results are drawn at the floor of the log scale
    deviation.barh([names.index(r.implementation) for r in judged],
                   [max(r.max_parameter_deviation, floor) for r in judged],
                   color=["tab:green" if r.verdict != "DEVIATES" else "tab:red" for r in judged])
    if judged:
        deviation.axvline(judged[0].parameter_tolerance, color="black", linestyle="--", label="tolerance")
        deviation.legend(fontsize=8)
    deviation.set_xscale("log")
    deviation.set_xlim(floor / 2, 1.0)
    deviation.set_xlabel("max |parameter - DDP's| after training (bitwise at the left edge)")
    deviation.set_title("deviation from DDP")
    memory.set_yticks(list(positions), names)
    memory.invert_yaxis()
    figure.suptitle(textwrap.fill(title, 180), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
