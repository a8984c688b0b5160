"""Ray Train's ``TorchTrainer`` with zeroimpl: the training function as Ray's guides write it, with ShardedOptimizer.

    python examples/ray_train.py                                 # stage 2, 2 CPU workers, a checkpoint every 4 steps
    python examples/ray_train.py --stage 1                       # Ray's default prepare_model (DDP) and stage 1
    python examples/ray_train.py --kill-at 6                     # a worker killed in step 6, restarted by Ray
    python examples/ray_train.py --resume-workers 1              # then 1 worker resumes from the last checkpoint
    python examples/ray_train.py --optimizer torch               # the reference: Ray's DDP path + torch's AdamW
    python examples/ray_train.py --check                         # all of the above, checked (docs/ray.md)

What changes for zeroimpl, against Ray's guide for a torch optimizer:

* ``prepare_model``: stage 1 keeps Ray's default (DistributedDataParallel; ShardedOptimizer takes its shard of
  DDP's averaged gradients); stage 2 passes ``parallel_strategy=None`` (ShardedOptimizer reduces the gradients
  itself, so the model is not wrapped).
* Checkpoints: every worker calls ``zeroimpl.checkpoint.save_checkpoint`` into a temporary folder of its own and
  reports it with ``ray.train.report(..., checkpoint=Checkpoint.from_directory(folder))``. Each worker writes its
  own shard there (rank 0 also the index), and Ray merges the workers' folders into one checkpoint in
  ``storage_path``. A restarted or new run reads it back with ``ray.train.get_checkpoint()`` and
  ``load_checkpoint``, at any number of workers.

Each step trains on one global batch split evenly over the workers, so runs at different worker counts compute
the same averaged gradient up to summation order. The final parameters are written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile

import torch

from zeroimpl import ShardedOptimizer
from zeroimpl.checkpoint import load_checkpoint, save_checkpoint

GLOBAL_BATCH = 12  # sequences per step, split over the workers
SEQUENCE = 16
VOCABULARY = 256


def build_model() -> torch.nn.Module:
    """A small GPT-2, the same on every worker (the seed)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCABULARY, n_positions=SEQUENCE, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def local_batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    """This worker's slice of step ``step``'s global batch."""
    tokens = torch.randint(0, VOCABULARY, (GLOBAL_BATCH, SEQUENCE), generator=torch.Generator().manual_seed(step))
    per_rank = GLOBAL_BATCH // world_size
    return tokens[rank * per_rank:(rank + 1) * per_rank]


def train_func(config: dict) -> None:
    """Ray Train's training function, run by every worker."""
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    stage = config["stage"]
    model = ray.train.torch.prepare_model(build_model(), parallel_strategy="ddp" if stage == 1 else None)
    bare = getattr(model, "module", model)  # (what the checkpoint names parameters by)
    if config["optimizer"] == "torch":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-3)

    start = 0
    checkpoint = ray.train.get_checkpoint()  # a restarted worker group: this run's last reported checkpoint
    if checkpoint is None and config.get("resume_from"):  # a new run from another's (Ray Train v2's way)
        checkpoint = ray.train.Checkpoint(config["resume_from"])
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            if isinstance(optimizer, ShardedOptimizer):
                load_checkpoint(os.path.join(folder, "zeroimpl"), optimizer, bare)
            else:  # Ray's guide for a torch optimizer: rank 0's state dicts
                saved = torch.load(os.path.join(folder, "torch.pt"))
                bare.load_state_dict(saved["model"])
                optimizer.load_state_dict(saved["optimizer"])
            with open(os.path.join(folder, "progress.json")) as handle:
                start = json.load(handle)["step"]
    for step in range(start, config["steps"]):
        if step == config["kill_at"] and rank == world_size - 1 and checkpoint is None:
            os.kill(os.getpid(), signal.SIGKILL)  # the first attempt's last worker dies in this step
        optimizer.zero_grad()
        tokens = local_batch(step, rank, world_size)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        metrics = {"step": step + 1, "loss": loss.item(), "started_at": start}
        if (step + 1) % config["checkpoint_every"] == 0 or step + 1 == config["steps"]:
            with tempfile.TemporaryDirectory() as folder:  # this worker's own: Ray merges the workers' folders
                if isinstance(optimizer, ShardedOptimizer):
                    save_checkpoint(os.path.join(folder, "zeroimpl"), optimizer, bare)
                elif rank == 0:
                    torch.save({"model": bare.state_dict(), "optimizer": optimizer.state_dict()},
                               os.path.join(folder, "torch.pt"))
                if rank == 0:
                    with open(os.path.join(folder, "progress.json"), "w") as handle:
                        json.dump({"step": step + 1}, handle)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
        else:
            ray.train.report(metrics)
    if config["out"] and rank == 0:
        torch.save({name: p.detach().clone() for name, p in bare.named_parameters()}, config["out"])


def fit(workers: int, storage: str, name: str, **config):
    """One ``TorchTrainer.fit``; returns its ``Result``. A killed worker restarts the worker group once, from the
    last reported checkpoint."""
    import ray.train
    import ray.train.torch

    trainer = ray.train.torch.TorchTrainer(
        train_func, train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=ray.train.RunConfig(storage_path=storage, name=name,
                                       failure_config=ray.train.FailureConfig(max_failures=1)))
    return trainer.fit()


RESUME_ATOL = 1e-5  # fewer workers: the same averaged gradients summed in another order (measured 9.0e-7)


def check(storage: str) -> bool:
    """The recipe's checks on 2 workers against Ray's DDP path + torch's AdamW (docs/ray.md): stage 1 under Ray's
    default prepare_model bitwise; stage 2 with a worker killed in step 6 and restarted, bitwise; a new run on 1
    worker from the step-4 checkpoint within RESUME_ATOL. Prints one line per check; returns whether all held."""
    base = {"steps": 12, "checkpoint_every": 4, "kill_at": -1, "stage": 2, "optimizer": "zeroimpl"}

    def final(name: str, workers: int, **config):
        out = os.path.join(storage, f"{name}.pt")
        result = fit(workers, storage, name, **{**base, **config}, out=out)
        if result.error is not None:
            raise result.error
        return result, torch.load(out)

    _, reference = final("reference", 2, stage=1, optimizer="torch")
    _, stage1 = final("stage-1", 2, stage=1)
    killed, stage2 = final("stage-2-killed", 2, kill_at=6)
    first = next(c for c, metrics in killed.best_checkpoints if metrics["step"] == base["checkpoint_every"])
    resumed, fewer = final("one-worker", 1, resume_from=first.path)
    difference = max((fewer[n] - reference[n]).abs().max().item() for n in reference)
    checks = {
        "stage 1 under Ray's default prepare_model, bitwise Ray's DDP + AdamW": all(
            torch.equal(stage1[n], reference[n]) for n in reference),
        "stage 2, a worker killed in step 6 and restarted from step 4, bitwise": killed.metrics["started_at"] == 4
        and all(torch.equal(stage2[n], reference[n]) for n in reference),
        f"1 worker from the 2 workers' step-4 checkpoint, within {RESUME_ATOL} (measured {difference:.1e})":
            resumed.metrics["started_at"] == 4 and difference < RESUME_ATOL,
    }
    for what, held in checks.items():
        print(f"{'ok  ' if held else 'FAIL'} {what}")
    return all(checks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--stage", type=int, choices=(1, 2), default=2)
    parser.add_argument("--optimizer", choices=("zeroimpl", "torch"), default="zeroimpl")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=-1, help="the last worker kills itself in this step, once")
    parser.add_argument("--resume-workers", type=int, default=0,
                        help="then a new run on this many workers resumes from the first run's checkpoint at step "
                             "--checkpoint-every (0: none)")
    parser.add_argument("--storage", default=os.path.join(tempfile.gettempdir(), "zeroimpl-ray"))
    parser.add_argument("--out", default="", help="write the final parameters here (rank 0)")
    parser.add_argument("--check", action="store_true", help="run the recipe's checks (docs/ray.md); exit 1 on failure")
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=max(args.workers, args.resume_workers), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        if args.check:
            with tempfile.TemporaryDirectory() as storage:
                raise SystemExit(0 if check(storage) else 1)
        config = {"stage": args.stage, "optimizer": args.optimizer, "steps": args.steps,
                  "checkpoint_every": args.checkpoint_every, "kill_at": args.kill_at}
        result = fit(args.workers, args.storage, f"run-{os.getpid()}", **config, out=args.out)
        if result.error is not None:
            raise result.error
        print(f"{args.workers} workers: step {result.metrics['step']}, loss {result.metrics['loss']:.4f}")
        if args.resume_workers:
            first = next(c for c, metrics in result.best_checkpoints if metrics["step"] == args.checkpoint_every)
            resumed = fit(args.resume_workers, args.storage, f"resumed-{os.getpid()}", **config,
                          resume_from=first.path, out=args.out and args.out + ".resumed")
            if resumed.error is not None:
                raise resumed.error
            print(f"{args.resume_workers} workers from step {args.checkpoint_every}: step "
                  f"{resumed.metrics['step']}, loss {resumed.metrics['loss']:.4f}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
