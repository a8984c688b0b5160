"""Regenerate the tables that README.md and docs/ quote from the committed results in benchmarks/results/.

    python benchmarks/render_docs.py          # rewrite the generated blocks in place
    python benchmarks/render_docs.py --check  # exit 1, with a diff, if any block differs from the results

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``; NAME picks
the renderer below. ``tests/test_docs.py`` runs ``--check``, so a result file re-run without rendering, or
a table edited by hand, fails the suite.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGES = ("README.md",) + tuple(sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
                                     if name.endswith(".md")))
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)", re.S)
MIB = 2**20

# benchmarks/network.py's reading of a tc rate (this script's folder is on the path)
from network import bits_per_second  # noqa: E402


def comparison() -> str:
    """The side-by-side run's table, with its caption and the command and machine it came from."""
    text = open(os.path.join(RESULTS, "comparison", "comparison.md")).read()
    caption, provenance, table = text.strip().split("\n\n", 2)
    return f"{table}\n\n{caption}  \n{provenance}\n"


def peers() -> str:
    """One row per implementation from ``benchmarks/peers.py``'s results at world size 2 (step time at 1, 2, 4)."""
    results = json.load(open(os.path.join(RESULTS, "peers", "results.json")))
    by_size = {n: {r["implementation"]: r for r in rows} for n, rows in results["rows"].items()}
    live = {r["implementation"]: r for r in results["live_memory_rows"]}
    volume = {accum: entries for accum, entries in results["communication"].items()}
    lines = ["| implementation | model states | peak RSS | live peak | step time vs DDP (N=1 / 2 / 4) "
             "| volume per step, accum 1 / 2 |", "|---|---|---|---|---|---|"]
    for name, row in by_size["2"].items():
        if row["outcome"] != "ran":
            continue
        times = " / ".join(f"{by_size[n][name]['step_time_vs_ddp']:.2f}x" for n in ("1", "2", "4"))
        moved = " / ".join(f"{volume[a][name]['volume_over_psi']:.3g}Ψ" for a in ("1", "2"))
        lines.append(f"| {name} | {row['model_state_bytes']['total'] / MIB:.0f} | {row['peak_bytes'] / MIB:.0f} "
                     f"| {live[name]['peak_bytes'] / MIB:.0f} | {times} | {moved} |")
    return "\n".join(lines) + "\n"


def markdown_table(name: str) -> list[list[str]]:
    """The rows (header first, the separator dropped) of the one table in a results Markdown file."""
    lines = [line for line in open(os.path.join(RESULTS, name)).read().splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if not set(line) <= set("|- ")]


def host_step() -> str:
    """``benchmarks/host_step.py``'s kernels and zeroimpl's whole offload ``step()``, parameters per second."""
    results = json.load(open(os.path.join(RESULTS, "host_step.json")))
    speed = {(r["implementation"], r["params"]): r["params_per_s"] for r in results["rows"]}
    columns = ["torch AdamW for-loop", "torch AdamW fused", "DeepSpeedCPUAdam", "zeroimpl offload step()"]
    lines = ["| parameters | torch AdamW for-loop | torch AdamW fused (zeroimpl's kernel) | DeepSpeedCPUAdam "
             "| zeroimpl whole `step()` |", "| --- | --- | --- | --- | --- |"]
    for params in sorted({p for _, p in speed}):
        cells = []
        for column in columns:
            value = speed.get((column, params))
            deepspeed = speed.get(("DeepSpeedCPUAdam", params))
            text = "-" if value is None else f"{value / 1e6:,.0f} M/s"
            if value is not None and deepspeed and column in ("torch AdamW fused", "zeroimpl offload step()"):
                text += f" ({value / deepspeed:.2f}x DeepSpeed)"
            cells.append(text)
        lines.append(f"| {params / 1e6:g}M | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nMachine: {results['machine']}.  \nCommand: `{results['command'].strip()}`\n"


def overlap() -> str:
    """``benchmarks/overlap.py``'s step time, overlapped / waited in ``step()``, one column per world size."""
    header, *rows = markdown_table("overlap.md")
    size, world, ratio = header.index("GPT-2"), header.index("world size"), header.index("overlapped / waited")
    worlds = sorted({int(r[world]) for r in rows})
    by_size: dict[str, dict[int, str]] = {}
    for row in rows:
        by_size.setdefault(row[size], {})[int(row[world])] = row[ratio]
    lines = ["| GPT-2 | " + " | ".join(f"{n} ranks" for n in worlds) + " |", "| --- |" + " --- |" * len(worlds)]
    lines += [f"| {name} | " + " | ".join(cells.get(n, "-") for n in worlds) + " |" for name, cells in by_size.items()]
    return "\n".join(lines) + "\n"


def verify() -> str:
    """``benchmarks/verify_cost.py``'s cost of one ``verify_every`` check against a training step."""
    header, *rows = markdown_table("verify.md")
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def network(report: str = "network") -> str:
    """``benchmarks/network.py``'s two simulated nodes (``report``: its results' stem): step time (and vs DDP)
    and bytes across the link per step -- with the time the link alone needs for them where a rate is shaped
    in the link-bound report -- one row per model and implementation, one column group per link rate."""
    results = json.load(open(os.path.join(RESULTS, "network", f"{report}.json")))
    cells = {(c["size"], c["rate"], c["implementation"]): c for c in results["cells"]}
    rates = list(dict.fromkeys(c["rate"] for c in results["cells"]))
    # the link-alone column, for a shaped rate of the link-bound report: bits per second, else None
    alone = {rate: bits_per_second(rate) if report != "network" else None for rate in rates}
    header = "| model | implementation | " + " | ".join(
        f"{r}: step time (vs DDP) | {r}: MB across per step" + (f" | {r}: link alone" if alone[r] else "")
        for r in rates) + " | loss | model states (MiB) |"
    lines = [header, "|" + " --- |" * (4 + sum(3 if alone[r] else 2 for r in rates))]
    for size, implementation in dict.fromkeys((c["size"], c["implementation"]) for c in results["cells"]):
        row, last = [], None
        for rate in rates:
            cell, ddp = cells.get((size, rate, implementation)), cells.get((size, rate, "ddp"))
            if cell is None:
                row += ["-"] * (3 if alone[rate] else 2)
                continue
            ratio = f" ({cell['median_step_seconds'] / ddp['median_step_seconds']:.2f}x)" if ddp else ""
            row += [f"{cell['median_step_seconds']:.3f} s{ratio}", f"{cell['link_bytes_per_step'] / 1e6:.1f}"]
            if alone[rate]:
                row.append(f"{cell['link_bytes_per_step'] / 2 * 8 / alone[rate]:.3f} s")
            last = cell
        lines.append(f"| gpt2 {size} | {implementation} | " + " | ".join(row)
                     + f" | {last['final_loss']:.4f} | {last['model_state_mib']:.1f} |")
    return "\n".join(lines) + f"\n\nCommand: `{results['command']}`\n"


def results_table(name: str) -> str:
    """A results Markdown file as it is (``name``: under results/), less its headings, which would be the page's."""
    lines = open(os.path.join(RESULTS, name)).read().strip().splitlines()
    text = "\n".join(line for line in lines if not line.startswith("#")).strip()
    return re.sub(r"\n{3,}", "\n\n", text) + "\n"


RENDERERS = {"comparison": comparison, "peers": peers, "host-step": host_step, "overlap": overlap, "verify": verify,
             "network": network, "link-bound": lambda: network("link-bound"),
             "overhead": lambda: results_table("overhead/overhead.md"),
             "overhead-phases": lambda: results_table("overhead/phases.md"),
             "codec-cost": lambda: results_table("codec_cost.md"),
             "checkpoint-scaling": lambda: results_table("checkpoint_scaling.md")}


def render(text: str) -> str:
    def block(match: re.Match) -> str:
        name = match.group("name")
        if name not in RENDERERS:
            raise KeyError(f"unknown generated block {name!r}; known: {sorted(RENDERERS)}")
        return match.group(1) + RENDERERS[name]() + match.group(4)
    return BLOCK.sub(block, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is out of date")
    args = parser.parse_args()
    stale = []
    for page in PAGES:
        path = os.path.join(ROOT, page)
        current = open(path).read()
        rendered = render(current)
        if rendered == current:
            continue
        stale.append(page)
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), rendered.splitlines(True), page,
                                                       f"{page} (rendered from benchmarks/results)"))
        else:
            open(path, "w").write(rendered)
    if args.check and stale:
        print(f"\nout of date: {', '.join(stale)}; run python benchmarks/render_docs.py", file=sys.stderr)
        return 1
    print("rewrote " + ", ".join(stale) if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
