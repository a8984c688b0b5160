"""Train a small causal LM with Hugging Face Trainer and zeroimpl (ZeRO stage 1/2, CPU offload).

    torchrun --nproc_per_node 2 examples/trainer.py [--stage 2] [--offload] [--steps 40] [--accum 2]

The change from a plain Trainer script is two lines: import ZeroTrainer, and construct it instead of
Trainer with ``zero_stage=...``. ``--plugin none`` runs the plain Trainer (DDP + AdamW) for comparison.
Data is a synthetic in-memory corpus (no download). At the end every rank prints what it holds in memory.
``--save-steps``/``--resume`` exercise sharded checkpoints; ``--dump FILE`` writes the logged losses and the
final parameters (rank 0) for the tests.
"""

import argparse
import os

import torch
import torch.distributed as dist
import transformers

from zeroimpl.integrations.collectives import CollectiveCounter
from zeroimpl.integrations.trainer import ZeroTrainer


class CollectivesPerStep(transformers.TrainerCallback):
    """Collects the collectives of each optimizer step (``--count-collectives``)."""

    def __init__(self, counter: CollectiveCounter):
        self.counter = counter
        self.per_step: list[list] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append([tuple(call) for call in self.counter.take()])


class SyntheticCorpus(torch.utils.data.Dataset):
    """``size`` fixed random sequences (seeded): the model memorises them, so the loss visibly falls."""

    def __init__(self, vocab: int, seq_len: int, size: int = 256, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (size, seq_len), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def use_loss_scaler(trainer: transformers.Trainer, initial_scale: float) -> None:
    """The GradScaler accelerate makes for ``fp16=True``, with our initial scale. accelerate turns fp16 into
    autocast and a GradScaler on accelerators only (on CPU it silently trains in fp32), so on CPU this also
    does what it does on a GPU: the fp16 path then runs on CPU as well. ZeroTrainer copies the settings."""
    trainer.accelerator.native_amp = True  # prepare_model wraps forward in torch.autocast(device, float16)
    trainer.accelerator.scaler = torch.amp.GradScaler(trainer.args.device.type, init_scale=initial_scale)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plugin", default="zero", choices=["zero", "none"])
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2])
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="per device")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--optim", default=transformers.TrainingArguments.optim,
                        help="Trainer's optimizer name (default: Trainer's, the fused AdamW)")
    parser.add_argument("--muon-lr", type=float, default=None,
                        help="train the hidden matrices with torch.optim.Muon at this learning rate (zeroimpl only)")
    parser.add_argument("--mesh", type=int, default=None, metavar="REPLICAS",
                        help="hybrid sharding on a REPLICAS x (world / REPLICAS) device mesh (zeroimpl only)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fp16", action="store_true", help="fp16 autocast with dynamic loss scaling (on CPU too)")
    parser.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16,
                        help="fp16: first loss scale (a high one makes the first steps overflow and be skipped)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--resume", default=None, help="checkpoint folder to resume from")
    parser.add_argument("--output-dir", default="runs/trainer")
    parser.add_argument("--dump", default=None, help="write losses and final parameters here (torch.save)")
    parser.add_argument("--count-collectives", action="store_true",
                        help="record every torch.distributed collective per optimizer step (into --dump)")
    return parser.parse_args()


def use_cuda() -> bool:
    """A GPU per rank on this node, and no CPU (gloo) process group set up already (as a test's ranks have)."""
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return enough and (not dist.is_initialized() or dist.get_backend() == "nccl")


def hybrid_mesh(replicas: int, cuda: bool):
    """A replicas x (world / replicas) DeviceMesh (replicate x shard) over this job's ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():  # Trainer initialises the process group when it builds its arguments
        dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    if world % replicas:
        raise SystemExit(f"--mesh {replicas} needs a world size divisible by it, got {world}")
    return init_device_mesh("cuda" if cuda else "cpu", (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))


def main():
    args = parse_args()
    cuda = use_cuda()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=args.width, n_layer=args.layers,
                                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accum, learning_rate=args.lr, weight_decay=0.01,
        max_grad_norm=args.max_grad_norm, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        optim=args.optim, bf16=args.bf16, fp16=args.fp16, use_cpu=not cuda, ddp_backend=None if cuda else "gloo",
        report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    dataset = SyntheticCorpus(config.vocab_size, 32)
    evaluation = SyntheticCorpus(config.vocab_size, 32, size=32, seed=1)
    if args.plugin == "zero":
        trainer = ZeroTrainer(model=model, args=training_args, train_dataset=dataset, eval_dataset=evaluation,
                              zero_stage=args.stage, zero_offload="cpu" if args.offload else None,
                              zero_muon=None if args.muon_lr is None else {"lr": args.muon_lr},
                              zero_options={"device_mesh": hybrid_mesh(args.mesh, cuda)} if args.mesh else None)
    else:
        trainer = transformers.Trainer(model=model, args=training_args, train_dataset=dataset, eval_dataset=evaluation)
    if args.fp16:
        use_loss_scaler(trainer, args.initial_loss_scale)
    counted = None
    if args.count_collectives:
        counted = CollectivesPerStep(CollectiveCounter().install())
        trainer.add_callback(counted)
    trainer.train(resume_from_checkpoint=args.resume)
    if counted is not None:
        counted.counter.uninstall()
    eval_loss = trainer.evaluate()["eval_loss"]

    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.plugin == "zero":
        report = trainer.sharded_optimizer.memory_report()
        print(f"rank {rank}: device {report.device.total / 2**20:.2f} MiB {report.device.as_dict()}, "
              f"host {report.host.total / 2**20:.2f} MiB", flush=True)
    if args.dump and rank == 0:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
        scales = [entry["loss_scale"] for entry in trainer.state.log_history if "loss_scale" in entry]
        params = {name: p.detach().float().clone() for name, p in trainer.model.named_parameters()}
        torch.save({"losses": losses, "grad_norms": norms, "params": params, "step": trainer.state.global_step,
                    "loss_scales": scales,
                    "skipped_steps": trainer.sharded_optimizer.skipped_steps if args.plugin == "zero" else None,
                    "final_loss_scale": trainer.accelerator.scaler.get_scale() if args.fp16 else None,
                    "eval_loss": eval_loss, "learning_rates": [e["learning_rate"] for e in trainer.state.log_history
                                                              if "learning_rate" in e],
                    "collectives": counted.per_step if counted else None,
                    "muon_params": sum(len(g["params"]) for g in trainer.sharded_optimizer.param_groups
                                       if g["optimizer"] is torch.optim.Muon) if args.plugin == "zero" else None,
                    "layout": {"buckets": len(trainer.sharded_optimizer.layout.buckets),
                               "padded": trainer.sharded_optimizer.layout.padded_numel}
                    if args.plugin == "zero" else None}, args.dump)
    if dist.is_initialized():
        dist.barrier()  # tear gloo down together: a rank exiting while another still runs can abort in C++
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
