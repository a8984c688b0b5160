"""What a save writes, and what its agreements cost, as the ranks grow: measured at 2, 3 and 4 ranks, extrapolated.

GPT-2 (``zeroimpl.integrations.models`` sizes), stage 2, AdamW, one step taken (so that the state exists), then
saves to a directory every rank shares and to a directory of each rank's own (node-local), and a load of the
node-local save at the same world size, each ``--repeats`` times in the same processes (gloo, CPU,
``OMP_NUM_THREADS=1``). Per world size it records:

* the files and their bytes: every rank file, and what the first rank alone writes (the index and the model's
  extras);
* the save's and the load's wall time (the slowest rank's, median over the repeats), and how many checkpoint
  agreements each runs (counted by wrapping ``zeroimpl.comm.all_gather_objects`` and ``broadcast_object``, the
  calls they go through);
* one agreement alone: the median of ``--agreements`` all-gathers of an agreement's payload, with no file I/O
  between them (what an agreement costs beyond waiting for the slowest rank's writes).

The 1,000-rank figures are fits: rank-file bytes as ``a + b / N``, the index as ``a + b * N``, and one agreement
as ``a + b * (N - 1)`` (an all-gather over a ring of N ranks takes N - 1 hops; a tree or NCCL's algorithms take
fewer). Measured on one machine over loopback: at 3 and 4 ranks the processes outnumber its 2 cores, so the
slope is this machine's scheduling as much as the ring's, and the 1,000-rank figure is an upper bound for it.

    python benchmarks/checkpoint_scaling.py                # GPT-2 base at 2, 3 and 4 ranks
    python benchmarks/checkpoint_scaling.py --size small   # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zeroimpl.integrations.launch import run_distributed  # noqa: E402
from zeroimpl.integrations.models import SIZES, build_model  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
TARGET_RANKS = 1000


def _measure(rank: int, world_size: int, size: str, root: str, repeats: int, agreements: int) -> dict:
    import torch.distributed as dist

    import zeroimpl.comm as comm
    from zeroimpl import ShardedOptimizer
    from zeroimpl.checkpoint import load_checkpoint, save_checkpoint

    counted = {"calls": 0}

    def counting(collective):
        def counted_call(*args, **kwargs):
            counted["calls"] += 1
            return collective(*args, **kwargs)
        return counted_call
    comm.all_gather_objects = counting(comm.all_gather_objects)
    comm.broadcast_object = counting(comm.broadcast_object)

    model = build_model("gpt2", size)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-4)
    ids = torch.randint(0, SIZES[size][3], (2, SIZES[size][4]), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()

    def timed(action) -> tuple[float, int]:
        """The slowest rank's wall time of ``action`` (started together) and the agreements it ran."""
        dist.barrier()
        counted["calls"] = 0
        started = time.perf_counter()
        action()
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        calls = counted["calls"]
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed), calls

    shared, own = os.path.join(root, "shared"), os.path.join(root, f"rank{rank}", "checkpoint")
    out = {"rank": rank}
    for name, directory in (("shared", shared), ("node-local", own)):
        runs = [timed(lambda: save_checkpoint(directory, optimizer, model)) for _ in range(repeats)]
        out[f"{name} save s"] = statistics.median(seconds for seconds, _ in runs)
        out[f"{name} save agreements"] = runs[0][1]
    runs = [timed(lambda: load_checkpoint(own, optimizer, model)) for _ in range(repeats)]
    out["node-local load s"] = statistics.median(seconds for seconds, _ in runs)
    out["node-local load agreements"] = runs[0][1]
    dist.barrier()
    out["files"] = {name: os.path.getsize(os.path.join(own, name)) for name in sorted(os.listdir(own))}

    payload = ("RuntimeError: " + "x" * 60, (True, "0123456789abcdef"), rank)  # an agreement's size
    times = []
    for _ in range(agreements):
        dist.barrier()
        started = time.perf_counter()
        optimizer.topology.all_gather_objects(payload, "timed agreement")
        times.append(time.perf_counter() - started)
    out["agreement s"] = statistics.median(times)
    out["parameters"] = sum(p.numel() for p in model.parameters())
    if rank == 0:
        from zeroimpl.checkpoint.files import read  # what the load's index sharing sends
        out["index and extras pickled"] = len(pickle.dumps((read(own, "index.pt", None),
                                                            torch.load(os.path.join(own, "model-extras.pt")))))
    return out


def _fit(ns: list[int], values: list[float], basis) -> tuple[float, float]:
    """Least squares ``a + b * basis(n)``."""
    b, a = numpy.polyfit([basis(n) for n in ns], values, 1)
    return float(a), float(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="base", choices=sorted(SIZES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 3, 4])
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per directory kind")
    parser.add_argument("--agreements", type=int, default=50, help="agreements timed alone")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for world_size in args.ranks:
        print(f"GPT-2 {args.size} at {world_size} ranks ...", flush=True)
        root = tempfile.mkdtemp(prefix="zeroimpl-checkpoint-scaling-")
        try:
            by_rank = run_distributed(world_size, _measure, args.size, root, args.repeats, args.agreements)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        first = by_rank[0]
        rank_files = [r["files"][f"rank-{r['rank']:05d}.pt"] for r in by_rank]
        rows.append({"ranks": world_size, "parameters": first["parameters"],
                     **{key: first[key] for key in first if key.endswith((" s", "agreements"))},
                     "agreement s": max(r["agreement s"] for r in by_rank),
                     "rank file bytes": max(rank_files), "index bytes": first["files"]["index.pt"],
                     "extras bytes": first["files"]["model-extras.pt"],
                     "index and extras pickled": first["index and extras pickled"]})
        print(json.dumps(rows[-1]), flush=True)
    _write(rows, args)


def _write(rows: list[dict], args) -> None:
    ns = [row["ranks"] for row in rows]
    per_rank = _fit(ns, [row["rank file bytes"] for row in rows], lambda n: 1 / n)
    index = _fit(ns, [row["index bytes"] for row in rows], lambda n: n)
    agreement = _fit(ns, [row["agreement s"] for row in rows], lambda n: n - 1)
    at = TARGET_RANKS
    rank_bytes, index_bytes = per_rank[0] + per_rank[1] / at, index[0] + index[1] * at
    one_agreement = agreement[0] + agreement[1] * (at - 1)
    shared_agreements, local_agreements = rows[0]["shared save agreements"], rows[0]["node-local save agreements"]
    shared_sizes = rows[0]["index and extras pickled"]
    mib = 2 ** 20
    header = (f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {os.cpu_count()} cores, torch "
              f"{torch.__version__}, gloo over loopback, OMP_NUM_THREADS=1 per rank, GPT-2 {args.size} "
              f"({rows[0]['parameters'] / 1e6:.1f}M parameters), stage 2, AdamW (fp32 masters and two moments), by "
              f"`python benchmarks/checkpoint_scaling.py --size {args.size}`. Times: the slowest rank's, median of "
              f"{args.repeats}; one agreement: median of {args.agreements}.")
    lines = ["# Checkpoint saves as the ranks grow", "", header, "",
             "| ranks | rank file (each) | index (first rank) | extras (first rank) | save, shared dir | "
             "save, node-local | load, node-local | one agreement |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['ranks']} | {row['rank file bytes'] / mib:.2f} MiB | {row['index bytes'] / 1024:.1f} KiB "
                     f"| {row['extras bytes'] / 1024:.1f} KiB | {row['shared save s'] * 1e3:.0f} ms "
                     f"({row['shared save agreements']} agreements) | {row['node-local save s'] * 1e3:.0f} ms "
                     f"({row['node-local save agreements']}) | {row['node-local load s'] * 1e3:.0f} ms "
                     f"({row['node-local load agreements']}) | {row['agreement s'] * 1e3:.2f} ms |")
    lines += ["", f"## At {at:,} ranks, extrapolated from the rows above", "",
              f"- **Files per save**: {at:,} rank files and the first rank's index and extras ({at + 2:,} files). In "
              f"one shared directory, all {at + 2:,} in one folder; node-local, one file per rank's directory and "
              "three in the first rank's.",
              f"- **Bytes per rank**: {rank_bytes / mib:.3f} MiB (fit {per_rank[0] / 1024:.1f} KiB + "
              f"{per_rank[1] / mib:.1f} MiB / N: the model's masters and moments, 12 bytes a parameter, split N "
              "ways, and each file's own overhead).",
              f"- **What the first rank alone writes**: its rank file, the model's extras "
              f"({rows[0]['extras bytes'] / 1024:.1f} KiB, the same at any N) and the index: "
              f"{index_bytes / 1024:.0f} KiB (fit {index[0] / 1024:.1f} KiB + {index[1]:.0f} bytes × N: each rank "
              "file's name, size and SHA-256 are listed in it).",
              f"- **One agreement**: {one_agreement * 1e3:.1f} ms (fit {agreement[0] * 1e3:.2f} ms + "
              f"{agreement[1] * 1e3:.3f} ms × (N − 1)). A save runs {shared_agreements} into a shared directory "
              f"and {local_agreements} into node-local ones: {shared_agreements * one_agreement:.2f} s and "
              f"{local_agreements * one_agreement:.2f} s of agreements, beyond waiting for the slowest rank's "
              "writes.",
              f"- **A node-local load at the same world size** runs {rows[0]['node-local load agreements']} "
              "agreements; one of them shares the index and the extras from the first rank that holds them, by an "
              f"object broadcast: every rank receives them once ({shared_sizes / 1024:.0f} KiB at "
              f"{rows[0]['ranks']} ranks, about {(shared_sizes + index[1] * (at - rows[0]['ranks'])) / 1024:.0f} "
              f"KiB at {at:,}).", ""]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "checkpoint_scaling.md"), "w") as handle:
        handle.write("\n".join(lines))
    with open(os.path.join(RESULTS, "checkpoint_scaling.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
