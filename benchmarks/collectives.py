"""What each collective costs on this machine's backend: all-reduce against reduce-scatter and all-gather.

    torchrun --nproc_per_node 2 benchmarks/collectives.py [--numel 30000000] [--out benchmarks/results]

ZeRO replaces DDP's all-reduce of Ψ gradient elements by a reduce-scatter of Ψ plus an all-gather of Ψ
parameters: the same 2Ψ on the wire when the backend runs the ring algorithms (NCCL). Whether that is as
fast as an all-reduce depends on the backend's implementations, which this measures through zeroimpl's own
``zeroimpl.comm`` functions, with each of its algorithms (``native``: the backend's collectives;
``pairwise``: point-to-point exchanges): one tensor of ``--numel`` fp32 elements, whole and in buckets of
2**20, 2**22 and 2**24 elements (launched together, then waited for, as zeroimpl does), median of 7 after
2 warm-ups. Rank 0 writes collectives-<backend>.md.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from zeroimpl import comm


def timed(function, repeats: int = 7) -> float:
    for _ in range(2):
        function()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        function()
        dist.barrier()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def in_buckets(launch, tensors, outputs, algorithm=None):
    def run():
        os.environ["ZEROIMPL_COLLECTIVES"] = algorithm or ""
        for work in [launch(o, t, tag) for tag, (o, t) in enumerate(zip(outputs, tensors))]:
            work.wait()
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=30_000_000)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if backend == "nccl" else "cpu")
    numel = args.numel // (world * 8) * world * 8
    full = torch.randn(numel, device=device)
    rows = []
    for bucket in (numel, 2 ** 20, 2 ** 22, 2 ** 24):
        tensors = [full[i:i + bucket] for i in range(0, numel, bucket)]
        tensors = [t for t in tensors if t.numel() % world == 0]
        shards = [torch.empty(t.numel() // world, device=device) for t in tensors]
        times = [timed(in_buckets(lambda o, t, tag: dist.all_reduce(t, async_op=True), tensors, shards))]
        for algorithm in comm.ALGORITHMS:
            times.append(timed(in_buckets(lambda o, t, tag: comm.reduce_scatter(o, t, None, tag=tag),
                                          tensors, shards, algorithm)))
            times.append(timed(in_buckets(lambda o, t, tag: comm.all_gather(t, o, None, tag=tag),
                                          tensors, shards, algorithm)))
        rows.append((bucket, *times))
    if rank == 0:
        lines = [f"# Collectives on {backend}, {world} ranks, {numel:,} fp32 elements ({numel * 4 / 2 ** 20:.0f} MiB)",
                 "", f"Command: `torchrun --nproc_per_node {world} benchmarks/collectives.py --numel {args.numel}`; "
                 f"torch {torch.__version__}, {os.cpu_count()} CPU cores. Milliseconds, median of 7. RS: "
                 "reduce-scatter, AG: all-gather, through zeroimpl.comm with each algorithm.", "",
                 "| bucket (elements) | all-reduce | native RS | native AG | pairwise RS | pairwise AG | "
                 "native RS + AG over all-reduce | pairwise RS + AG over all-reduce |", "|---|---|---|---|---|---|---|---|"]
        for bucket, ar, rs, ag, prs, pag in rows:
            label = "whole tensor" if bucket == numel else f"{bucket:,}"
            lines.append(f"| {label} | {ar:.0f} | {rs:.0f} | {ag:.0f} | {prs:.0f} | {pag:.0f} | {(rs + ag) / ar:.2f}x "
                         f"| {(prs + pag) / ar:.2f}x |")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"collectives-{backend}.md"), "w") as handle:
            handle.write("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
