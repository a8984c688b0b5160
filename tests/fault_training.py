"""A training job for the fault and multi-node tests, run under torchrun: a small language model in plain torch
(``workloads.PlainLanguageModel``: no transformers to import in every rank), ZeRO stage 2, a checkpoint after every
step, resume from the newest complete checkpoint on start.

    torchrun --nproc_per_node 2 tests/fault_training.py OUT --steps 5 [--fault kill|hang --fault-step 3]
                                                        [--mesh REPLICAS] [--global-batch] [--join plain|throw]

``--mesh R``: hybrid sharding on an R x (world / R) DeviceMesh (replicate x shard). ``--global-batch``: every
rank trains on its slice of one fixed global batch per step (``workloads.local_batch``), so that runs at
different world sizes compute the same averaged gradient.

``--fault kill``: in torchrun's first attempt (TORCHELASTIC_RESTART_COUNT == 0), rank 1 kills itself
with SIGKILL after the backward of ``--fault-step``, before that step's optimizer step. ``--fault hang``:
rank 1 sleeps instead, and the others must stop within ``--collective-timeout``. ``--fault hang-save``:
rank 1 sleeps before that step's checkpoint, so the others wait in the checkpoint's own collectives. Rank 0 writes the final
parameters to ``OUT/final.pt``.
"""

import argparse
import contextlib
import os
import re
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import PlainLanguageModel, batch, local_batch, param_groups  # noqa: E402
from zeroimpl import ShardedOptimizer  # noqa: E402
from zeroimpl.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402


def newest_checkpoint(out: str):
    """(step, path) of the newest published checkpoint (saves publish atomically, so any listed one is whole)."""
    steps = [int(m.group(1)) for name in os.listdir(out) if (m := re.fullmatch(r"step-(\d+)", name))]
    return (max(steps), os.path.join(out, f"step-{max(steps)}")) if steps else (0, None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fault", choices=["none", "kill", "hang", "hang-save"], default="none")
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--collective-timeout", type=float, default=None)
    parser.add_argument("--checkpoint-timeout", type=float, default=None)
    parser.add_argument("--mesh", type=int, default=None, metavar="REPLICAS")
    parser.add_argument("--global-batch", action="store_true")
    parser.add_argument("--join", choices=["plain", "throw"], default=None,
                        help="train inside `with Join([optimizer])` (throw: throw_on_early_termination=True)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} of {dist.get_world_size()} on node {os.environ.get('GROUP_RANK', '0')}", flush=True)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    world_size = dist.get_world_size()
    mesh = None
    if args.mesh:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (args.mesh, world_size // args.mesh), mesh_dim_names=("replicate", "shard"))
    model = PlainLanguageModel()
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, lr=1e-2, bucket_numel=4096,
                                 collective_timeout=args.collective_timeout, device_mesh=mesh)
    os.makedirs(args.out, exist_ok=True)
    done, checkpoint = newest_checkpoint(args.out)
    if checkpoint:
        load_checkpoint(checkpoint, optimizer, model)
        print(f"rank {rank}: resumed from {os.path.basename(checkpoint)}", flush=True)
    join = Join([optimizer], throw_on_early_termination=args.join == "throw") if args.join else contextlib.nullcontext()
    with join:
        for step in range(done + 1, args.steps + 1):
            data = local_batch(step, rank, world_size) if args.global_batch else batch(rank, step, 0)
            optimizer.backward(model(**data).loss)
            if rank == 1 and first_attempt and step == args.fault_step:
                if args.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif args.fault == "hang":
                    time.sleep(600)
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
            if rank == 1 and first_attempt and step == args.fault_step and args.fault == "hang-save":
                time.sleep(600)
            save_checkpoint(os.path.join(args.out, f"step-{step}"), optimizer, model, timeout=args.checkpoint_timeout)
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, os.path.join(args.out, "final.pt"))
    dist.barrier()  # no rank tears gloo down while another still uses its connections
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # A rank whose collective failed cannot tear gloo down: the process group's destructor would wait for
        # that collective. Print the error and leave without finalizing, as docs/advanced.md ("Exiting") advises.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
