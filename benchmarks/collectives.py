"""What each collective costs on this machine's backend: all-reduce against reduce-scatter and all-gather.

    torchrun --nproc_per_node 2 benchmarks/collectives.py [--numel 30000000] [--out benchmarks/results]

ZeRO replaces DDP's all-reduce of Ψ gradient elements by a reduce-scatter of Ψ plus an all-gather of Ψ
parameters: the same 2Ψ on the wire when the backend runs the ring algorithms (NCCL). Whether that is as
fast as an all-reduce depends on the backend's implementations, which this measures: one tensor of
``--numel`` fp32 elements, whole and in buckets of 2**20, 2**22 and 2**24 elements (launched together,
then waited for, as zeroimpl does), median of 7 after 2 warm-ups. Rank 0 writes collectives-<backend>.md.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


# torch 2.13's names, or the older ones
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def in_buckets(launch, tensors, outputs):
    def run():
        for work in [launch(o, t) for o, t in zip(outputs, tensors)]:
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
        all_reduce = timed(in_buckets(lambda o, t: dist.all_reduce(t, async_op=True), tensors, shards))
        reduce_scatter = timed(in_buckets(lambda o, t: REDUCE_SCATTER(o, t, async_op=True), tensors, shards))
        all_gather = timed(in_buckets(lambda o, t: ALL_GATHER(t, o, async_op=True), tensors, shards))
        rows.append((bucket, all_reduce, reduce_scatter, all_gather))
    if rank == 0:
        lines = [f"# Collectives on {backend}, {world} ranks, {numel:,} fp32 elements ({numel * 4 / 2 ** 20:.0f} MiB)",
                 "", f"Command: `torchrun --nproc_per_node {world} benchmarks/collectives.py --numel {args.numel}`; "
                 f"torch {torch.__version__}, {os.cpu_count()} CPU cores. Milliseconds, median of 7.", "",
                 "| bucket (elements) | all-reduce | reduce-scatter | all-gather | reduce-scatter + all-gather "
                 "over all-reduce |", "|---|---|---|---|---|"]
        for bucket, ar, rs, ag in rows:
            label = "whole tensor" if bucket == numel else f"{bucket:,}"
            lines.append(f"| {label} | {ar:.0f} | {rs:.0f} | {ag:.0f} | {(rs + ag) / ar:.2f}x |")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"collectives-{backend}.md"), "w") as handle:
            handle.write("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
