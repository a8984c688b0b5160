"""Host optimizer step of CPU offload: parameters per second of AdamW implementations on the CPU.

Every implementation updates the same fp32 parameters, split into tensors of ``--chunk`` elements (zeroimpl's
inner optimizer sees one tensor per parameter piece in its shard; here each parameter fills one bucket),
with the same gradients and hyperparameters, in the same process and run:

* torch AdamW for-loop / foreach / fused -- torch's three CPU kernels (zeroimpl offload uses fused);
* DeepSpeedCPUAdam -- DeepSpeed's AVX/OpenMP CPU Adam (skipped, with a hint, if deepspeed is missing);
* zeroimpl offload step() -- the whole ``ShardedOptimizer(offload="cpu", stage=2).step()`` at world size 1
  (gradients delivered by a backward before the clock starts): the fused host step, writing the master back
  into the parameters and the (trivial) all-gather.

Reported: median seconds per step over the timed steps and parameters/s, plus the largest difference of the
parameters from torch's for-loop kernel after the timed steps (a correctness check, not a speed figure).

    python benchmarks/host_step.py              # 10M, 50M, 100M, 200M parameters
    python benchmarks/host_step.py --quick      # 10M, 50M
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

SIZES = (10_000_000, 50_000_000, 100_000_000, 200_000_000)
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def chunks(total: int, chunk: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sizes = [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])
    return [torch.randn(n, generator=generator) for n in sizes]


def torch_adamw(kernel: str):
    flags = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kernel]

    def make(params):
        return TorchStep(params, torch.optim.AdamW(params, **HYPER, **flags))
    return make


def deepspeed_cpu_adam(params):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    return TorchStep(params, DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER))


class TorchStep:
    """A torch optimizer (or DeepSpeedCPUAdam) whose gradients are set directly."""

    def __init__(self, params, optimizer):
        self.params, self.optimizer = params, optimizer

    def load_gradients(self, grads):
        for p, g in zip(self.params, grads):
            p.grad = g

    def step(self):
        self.optimizer.step()


class ZeroimplStep:
    """ShardedOptimizer(offload="cpu", stage=2) at world size 1; gradients arrive through backward."""

    def __init__(self, params, chunk: int):
        from zeroimpl import ShardedOptimizer
        self.params = params
        self.optimizer = ShardedOptimizer(params, torch.optim.AdamW, stage=2, offload="cpu", bucket_numel=chunk,
                                          **HYPER)

    def load_gradients(self, grads):
        self.optimizer.zero_grad()
        torch.autograd.backward(self.params, grads)  # reduced (a copy at world size 1) and moved to the host

    def step(self):
        self.optimizer.step()


def measure(name, make, total, chunk, warmup, steps, grads):
    params = [torch.nn.Parameter(t) for t in chunks(total, chunk, seed=0)]
    optimizer = make(params)
    timings = []
    for index in range(warmup + steps):
        optimizer.load_gradients(grads)
        start = time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - start
        if index >= warmup:
            timings.append(elapsed)
    seconds = statistics.median(timings)
    final = [p.detach().clone() for p in params]
    del optimizer, params
    gc.collect()
    return {"implementation": name, "params": total, "seconds": seconds, "params_per_s": total / seconds}, final


def deepspeed_available() -> str | None:
    """None if DeepSpeedCPUAdam can be built and run here, else why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])
    except Exception as error:  # ImportError, or the JIT build failing
        return f"{type(error).__name__}: {error}".splitlines()[0] + "  (pip install deepspeed ninja)"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10M and 50M parameters only")
    parser.add_argument("--sizes", type=float, nargs="*", help="parameter counts in millions")
    parser.add_argument("--chunk", type=int, default=2 ** 22, help="elements per tensor (a bucket shard)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "host_step"))
    args = parser.parse_args()
    sizes = [int(s * 1e6) for s in args.sizes] if args.sizes else SIZES[:2] if args.quick else SIZES
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # DeepSpeedCPUAdam's OpenMP threads

    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        skipped = deepspeed_available()
        implementations = [("torch AdamW for-loop", torch_adamw("for-loop")),
                           ("torch AdamW foreach", torch_adamw("foreach")),
                           ("torch AdamW fused", torch_adamw("fused"))]
        if skipped is None:
            implementations.append(("DeepSpeedCPUAdam", deepspeed_cpu_adam))
        else:
            print(f"DeepSpeedCPUAdam skipped: {skipped}", file=sys.stderr)
        implementations.append(("zeroimpl offload step()", lambda params: ZeroimplStep(params, args.chunk)))

        rows = []
        for total in sizes:
            grads = [g * 1e-3 for g in chunks(total, args.chunk, seed=1)]
            reference = None
            for name, make in implementations:
                print(f"{total / 1e6:.0f}M params: {name} ...", file=sys.stderr, flush=True)
                row, final = measure(name, make, total, args.chunk, args.warmup, args.steps, grads)
                if reference is None:
                    reference = final
                row["max_abs_diff_vs_for_loop"] = max((a - b).abs().max().item() for a, b in zip(final, reference))
                rows.append(row)
                print(f"  {row['seconds'] * 1e3:8.1f} ms  {row['params_per_s'] / 1e6:8.1f} M params/s", file=sys.stderr)
            del grads, reference
            gc.collect()
        dist.destroy_process_group()

    write(rows, args, skipped)


def write(rows, args, skipped) -> None:
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} threads; "
               f"python {platform.python_version()}, torch {torch.__version__}")
    try:
        import deepspeed
        machine += f", deepspeed {deepspeed.__version__}"
    except ImportError:
        pass
    command = "python benchmarks/host_step.py " + " ".join(sys.argv[1:])
    by_size = {}
    for row in rows:
        by_size.setdefault(row["params"], {})[row["implementation"]] = row
    lines = ["# Host optimizer step (CPU offload), AdamW, parameters per second", "",
             f"Machine: {machine}.  ", f"Command: `{command.strip()}`; median of {args.steps} steps after "
             f"{args.warmup} warm-up steps, fp32, tensors of {args.chunk} elements.", ""]
    if skipped:
        lines += [f"DeepSpeedCPUAdam was skipped: {skipped}", ""]
    names = list(dict.fromkeys(row["implementation"] for row in rows))
    lines.append("| parameters | " + " | ".join(names) + " | fused / DeepSpeedCPUAdam | zeroimpl step() / DeepSpeedCPUAdam |")
    lines.append("|---" * (len(names) + 3) + "|")
    for size, found in by_size.items():
        cells = [f"{found[n]['params_per_s'] / 1e6:,.0f} M/s ({found[n]['seconds'] * 1e3:.0f} ms)" if n in found
                 else "-" for n in names]
        ratios = ["-", "-"]
        if "DeepSpeedCPUAdam" in found:
            ratios = [f"{found[n]['params_per_s'] / found['DeepSpeedCPUAdam']['params_per_s']:.2f}x"
                      for n in ("torch AdamW fused", "zeroimpl offload step()")]
        lines.append(f"| {size / 1e6:.0f}M | " + " | ".join(cells + ratios) + " |")
    lines += ["", "Speed is parameters per second (higher is better). The zeroimpl column is the whole "
              "`step()`: the fused kernel plus writing the updated fp32 master into the parameters (here the "
              "\"device\" is the CPU, so that is a memory copy); the other columns are the kernel alone."]
    lines += ["", "Largest parameter difference from torch's for-loop kernel after the timed steps:", ""]
    for size, found in by_size.items():
        lines.append(f"- {size / 1e6:.0f}M: " + ", ".join(
            f"{n} {found[n]['max_abs_diff_vs_for_loop']:.1e}" for n in names if n in found))
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    with open(args.output + ".json", "w") as handle:
        json.dump({"machine": machine, "command": command, "rows": rows}, handle, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
