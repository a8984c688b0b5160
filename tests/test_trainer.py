"""Hugging Face Trainer + ZeroTrainer under torchrun (2 ranks, gloo): parity with Trainer + DDP + AdamW,
sharded checkpoints and resume on the same and on another world size.

Tolerances: Trainer logs losses rounded to 4 digits (so losses are compared to 1e-4); parameters within
PARAM_ATOL = 1e-4, the core parity tolerance (tests/test_optimizer_parity.py), since clipping computes the global norm
from shards in another summation order. bf16 autocast (fp32 parameters): a last-bit difference in an fp32
weight can round it to another bf16 value, and Adam can then move a near-zero-gradient element by up to 2 lr,
so bf16 is judged by the relative L2 distance of all parameters, BF16_REL_L2 = 2e-3 (measured 1.3e-3; bf16
itself moves them 2.5e-3 away from the fp32 run), and by the losses (2e-4). fp16 autocast with dynamic loss
scaling (torch's CPU fp16 autocast and GradScaler for the reference, as accelerate does on a GPU) is judged
the same way, with FP16_REL_L2; its first loss scale is set so high that the first three steps overflow.
Runs: tiny GPT-2 (2 layers, width 128), 6 steps, 2 micro-batches per step, max_grad_norm 1.0, linear
schedule with warm-up.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed
from zeroimpl.integrations.collectives import Call, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAM_ATOL = 1e-4
BF16_REL_L2 = 2e-3
FP16_REL_L2 = 2e-3
FP16 = ("--fp16", "--initial-loss-scale", str(2.0 ** 22),
        "--optim", "adamw_torch")  # not the fused AdamW: see test_fp16_matches_trainer_with_ddp
STEPS = 6
SCHEDULE_FREE = ("--optim", "schedule_free_adamw")


TRAINER = os.path.join(ROOT, "examples", "trainer.py")


def _run_script(rank, world_size, argv):
    """One rank of examples/trainer.py run whole, as ``python trainer.py ARGV`` (a forked rank: see ``train``)."""
    import contextlib
    import io
    import runpy

    sys.argv = [TRAINER, *argv]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(TRAINER, run_name="__main__")
    return printed.getvalue()


def train(tmp_path, name, *flags, nproc=2, accum=2, torchrun=False):
    """Run examples/trainer.py on ``nproc`` ranks; return what rank 0 dumped and what the ranks printed.

    ``torchrun=True``: under ``python -m torch.distributed.run`` (--standalone: a free port, so concurrent runs
    never collide), where Trainer initialises the process group itself from torchrun's environment. Otherwise
    each rank is forked from the tests' server that has imported torch and transformers once
    (``run_distributed``; RANK / LOCAL_RANK / WORLD_SIZE set as torchrun sets them, the process group already
    initialised, which Trainer then uses): the same script, without a new interpreter's seconds of imports per
    rank per run."""
    dump = str(tmp_path / f"{name}.pt")
    argv = ["--steps", str(STEPS), "--accum", str(accum), "--output-dir", str(tmp_path / name), "--dump", dump,
            *flags]
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   TRAINER, *argv]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
        printed = completed.stdout
    else:
        printed = "".join(run_distributed(nproc, _run_script, argv, timeout=600))
    return torch.load(dump, weights_only=True), printed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("trainer")
    results = {"ddp": train(tmp_path, "ddp", "--plugin", "none")}
    for stage in (1, 2):
        # stage 2 under torchrun itself, as users launch it; the other runs fork their ranks (see train)
        results[f"stage{stage}"] = train(tmp_path, f"stage{stage}", "--stage", str(stage), "--save-steps", "3",
                                         "--count-collectives", torchrun=stage == 2)
    results["stage2_offload"] = train(tmp_path, "stage2_offload", "--stage", "2", "--offload")
    results["ddp_bf16"] = train(tmp_path, "ddp_bf16", "--plugin", "none", "--bf16")
    results["stage2_bf16"] = train(tmp_path, "stage2_bf16", "--stage", "2", "--bf16")
    checkpoint = str(tmp_path / "stage2" / "checkpoint-3")
    results["resumed"] = train(tmp_path, "resumed", "--stage", "2", "--resume", checkpoint)
    # one rank with twice the accumulation: the same 16 sequences per optimizer step as 2 ranks
    results["resumed_on_1"] = train(tmp_path, "resumed_on_1", "--stage", "2", "--resume", checkpoint, nproc=1,
                                       accum=4)
    results["ddp_fp16"] = train(tmp_path, "ddp_fp16", "--plugin", "none", *FP16)
    results["stage2_fp16"] = train(tmp_path, "stage2_fp16", "--stage", "2", "--save-steps", "3", *FP16)
    results["resumed_fp16"] = train(tmp_path, "resumed_fp16", "--stage", "2", *FP16, "--resume",
                                       str(tmp_path / "stage2_fp16" / "checkpoint-3"))
    results["checkpoint_files"] = sorted(os.listdir(os.path.join(checkpoint, "zeroimpl")))
    results["ddp_4"] = train(tmp_path, "ddp_4", "--plugin", "none", nproc=4)
    results["mesh_2x2"] = train(tmp_path, "mesh_2x2", "--stage", "2", "--mesh", "2", nproc=4)
    results["muon_stage2"] = train(tmp_path, "muon_stage2", "--stage", "2", "--muon-lr", "0.02", accum=1)
    # schedule-free AdamW: Trainer switches optimizer.train() / .eval() around training and evaluation
    results["ddp_schedule_free"] = train(tmp_path, "ddp_schedule_free", "--plugin", "none", *SCHEDULE_FREE)
    results["stage2_schedule_free"] = train(tmp_path, "stage2_schedule_free", "--stage", "2", *SCHEDULE_FREE)
    return results


def max_param_diff(a, b):
    return max((a["params"][n] - b["params"][n]).abs().max().item() for n in b["params"])


@pytest.mark.parametrize("stage", [1, 2])
def test_losses_and_parameters_match_trainer_with_ddp(runs, stage):
    zero, stdout = runs[f"stage{stage}"]
    ddp, _ = runs["ddp"]
    assert len(zero["losses"]) == len(ddp["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) <= 1e-4
    assert max(abs(a - b) for a, b in zip(zero["grad_norms"], ddp["grad_norms"])) <= 1e-4
    assert max_param_diff(zero, ddp) <= PARAM_ATOL
    assert zero["learning_rates"] == ddp["learning_rates"]  # the schedule, as logged
    assert abs(zero["eval_loss"] - ddp["eval_loss"]) <= 1e-4
    assert "rank 0: device" in stdout and "rank 1: device" in stdout  # the memory report of every rank


def test_checkpoints_are_sharded_per_rank(runs):
    assert runs["checkpoint_files"] == ["index.pt", "model-extras.pt", "rank-00000.pt", "rank-00001.pt"]


def test_resume_reaches_the_uninterrupted_parameters(runs):
    resumed, _ = runs["resumed"]
    uninterrupted, _ = runs["stage2"]
    assert resumed["step"] == STEPS
    assert resumed["losses"] == uninterrupted["losses"]  # the log history of steps 1-3 comes from the checkpoint
    assert max_param_diff(resumed, uninterrupted) == 0.0


def test_resume_on_one_rank_reaches_the_uninterrupted_parameters(runs):
    """Saved on 2 ranks at step 3, resumed on 1 rank with accumulation 4 (the same global batch): the result
    equals the uninterrupted 2-rank run up to summation order (measured 1.0e-6)."""
    resumed, _ = runs["resumed_on_1"]
    uninterrupted, _ = runs["stage2"]
    assert resumed["step"] == STEPS and resumed["losses"][:3] == uninterrupted["losses"][:3]
    assert max(abs(a - b) for a, b in zip(resumed["losses"][3:], uninterrupted["losses"][3:])) <= 1e-4
    assert max_param_diff(resumed, uninterrupted) <= PARAM_ATOL
    assert max_param_diff(resumed, uninterrupted) > 0.0  # it really ran on one rank, in another order


@pytest.mark.parametrize("setting", [{"deepspeed": {"zero_optimization": {"stage": 2}}}, {"fsdp": "full_shard"}])
def test_conflicting_training_arguments_are_refused(tmp_path, setting):
    """Checked before Trainer builds anything, so no process group or accelerator is needed."""
    import transformers

    from zeroimpl.integrations.trainer import check_training_arguments

    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    for key, value in setting.items():
        object.__setattr__(arguments, key, value)  # TrainingArguments would start DeepSpeed / FSDP itself
    with pytest.raises(ValueError, match="ZeroTrainer"):
        check_training_arguments(arguments)


def test_offload_is_bitwise_equal_to_no_offload(runs):
    """Both step with the fused AdamW kernel Trainer selects (adamw_torch_fused), so offload changes nothing."""
    offload, stdout = runs["stage2_offload"]
    device, _ = runs["stage2"]
    assert offload["losses"] == device["losses"] and offload["eval_loss"] == device["eval_loss"]
    assert max_param_diff(offload, device) == 0.0
    assert "host 0.00 MiB" not in stdout  # the shard's master and state live on the host


def test_bf16_autocast_matches_trainer_with_ddp(runs):
    zero, _ = runs["stage2_bf16"]
    ddp, _ = runs["ddp_bf16"]
    assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) <= 2e-4
    assert abs(zero["eval_loss"] - ddp["eval_loss"]) <= 1e-4
    assert relative_distance(zero, ddp) <= BF16_REL_L2
    assert relative_distance(zero, runs["stage2"][0]) > 5e-4  # autocast really ran in bf16 (fp32: 2.5e-3 away)


def relative_distance(a, b):
    distance = sum(((a["params"][n] - b["params"][n]) ** 2).sum() for n in b["params"]) ** 0.5
    return (distance / sum((p ** 2).sum() for p in b["params"].values()) ** 0.5).item()


@pytest.mark.parametrize("stage", [1, 2])
def test_trainer_adds_no_gradient_communication(runs, stage):
    """Per optimizer step (2 micro-batches): stage 1 reduce-scatters the gradients once, stage 2 once per
    micro-batch; one all-gather of the parameters (on gloo both as pairwise exchanges); the step's checks
    (NaN/Inf flag, clipping norm, backward-pass counts, missing-gradient flag: 5 elements) and Trainer's logging
    gathers (scalars) -- no gradient all-reduce, so no DDP underneath. Step 1 also holds start-up traffic, and step 4 the checkpoint saved after step 3
    (object gathers): both are left out."""
    zero, _ = runs[f"stage{stage}"]
    buckets, padded = zero["layout"]["buckets"], zero["layout"]["padded"]
    reductions = 2 if stage == 2 else 1
    steps = [calls for step, calls in enumerate(zero["collectives"], start=1) if step not in (1, 4)]
    assert len(steps) == STEPS - 2
    for calls in steps:
        summary = {name: (count, total) for name, (count, total, _) in summarize([Call(*c) for c in calls]).items()}
        # gloo: the reduce-scatters and the all-gather as pairwise exchanges, half of each bucket each way
        assert summary.pop("isend") == summary.pop("irecv") == ((reductions + 1) * buckets,
                                                                (reductions + 1) * padded // 2)
        assert summary.pop("all_reduce") == (1, 5)  # NaN/Inf flag, clipping norm, pass counts, missing flag
        logging_elements = summary.pop("all_gather")[1]
        assert logging_elements <= 8 and summary == {}, summary


def test_fp16_matches_trainer_with_ddp_and_skips_the_same_steps(runs):
    """The first loss scale, 2**22, overflows fp16 three times: both skip steps 1-3, halve the scale to 2**19,
    and hold the LR schedule back. (The reference uses the unfused AdamW: with the fused one Trainer's
    schedule advances on skipped steps, because the fused kernel consumes the GradScaler's inf flag itself
    and accelerate then cannot see the skip; ZeroTrainer always holds the schedule back.)"""
    zero, _ = runs["stage2_fp16"]
    ddp, _ = runs["ddp_fp16"]
    assert zero["skipped_steps"] == 3
    assert zero["loss_scales"] == [2.0 ** 21, 2.0 ** 20] + [2.0 ** 19] * 4  # logged after each step
    assert zero["final_loss_scale"] == ddp["final_loss_scale"] == 2.0 ** 19
    assert zero["learning_rates"] == ddp["learning_rates"] and zero["learning_rates"][:4] == [0.0] * 4
    overflowed = [True] * 3 + [False] * 3
    assert [math.isnan(n) for n in zero["grad_norms"]] == [math.isnan(n) for n in ddp["grad_norms"]] == overflowed
    assert max(abs(a - b) for a, b in zip(zero["grad_norms"][3:], ddp["grad_norms"][3:])) <= 1e-4
    assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) <= 2e-4
    assert relative_distance(zero, ddp) <= FP16_REL_L2
    assert zero["losses"] != runs["stage2"][0]["losses"]  # autocast really ran in fp16


def test_fp16_resume_is_bitwise(runs):
    """The loss scale and its counters come back from the checkpoint (and Trainer's scaler.pt) exactly."""
    resumed, _ = runs["resumed_fp16"]
    uninterrupted, _ = runs["stage2_fp16"]
    assert resumed["losses"] == uninterrupted["losses"] and resumed["loss_scales"] == uninterrupted["loss_scales"]
    assert max_param_diff(resumed, uninterrupted) == 0.0


def test_muon_for_the_hidden_matrices(runs):
    """zero_muon={"lr": ...}: the 8 hidden matrices of the 2-layer GPT-2 (4 per block) step with Muon, the
    rest with AdamW, and training goes on from there; Muon's parity with DDP + torch.optim.Muon is
    tests/test_optimizer_kinds_whole_parameter.py's and tests/test_optimizer_semantics.py's."""
    muon = runs["muon_stage2"][0]
    assert muon["muon_params"] == 8
    assert len(muon["losses"]) == STEPS and all(math.isfinite(loss) for loss in muon["losses"])


def test_schedule_free_adamw_matches_trainer_with_ddp(runs):
    """optim="schedule_free_adamw": Trainer calls optimizer.train() before training and optimizer.eval()
    before evaluating; ZeroTrainer's ShardedOptimizer switches its master shards and all-gathers, so the
    evaluation sees the averaged point as under DDP (measured: losses and eval loss equal, parameters 7.4e-6)."""
    zero, ddp = runs["stage2_schedule_free"][0], runs["ddp_schedule_free"][0]
    assert len(zero["losses"]) == len(ddp["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) <= 1e-4
    assert abs(zero["eval_loss"] - ddp["eval_loss"]) <= 1e-4
    assert max_param_diff(zero, ddp) <= PARAM_ATOL


def test_hybrid_sharding_on_a_2x2_mesh_matches_trainer_with_ddp_on_4_ranks(runs):
    """zero_options={"device_mesh": 2 x 2 mesh}: 4 ranks, state sharded over 2 and replicated twice."""
    mesh, ddp = runs["mesh_2x2"][0], runs["ddp_4"][0]
    assert len(mesh["losses"]) == len(ddp["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(mesh["losses"], ddp["losses"])) <= 1e-4
    assert max_param_diff(mesh, ddp) <= PARAM_ATOL


def _tiny_gpt2():
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def _tiny_trainer(directory, fp16=False, arguments=None, **model_and_options):
    """ZeroTrainer (stage 2) over a 1-layer GPT-2 (``model=`` or ``model_init=``, and ZeroTrainer's options) for
    2 steps of 8 fixed sequences, on CPU; ``arguments``: more TrainingArguments."""
    import transformers
    from zeroimpl.integrations.trainer import ZeroTrainer

    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(output_dir=directory, max_steps=2, per_device_train_batch_size=2,
                                          use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no",
                                          disable_tqdm=True, fp16=fp16, **(arguments or {}))
    return ZeroTrainer(args=args, train_dataset=[{"input_ids": row, "labels": row} for row in ids], zero_stage=2,
                       **model_and_options)


def _optimizer_moved_by_accelerate(rank, world_size, directory):
    """What accelerate's device placement handed to ``move_to_device`` while ZeroTrainer (offload) trained a step."""
    import accelerate.optimizer

    moved, move = [], accelerate.optimizer.move_to_device
    accelerate.optimizer.move_to_device = lambda state, device: moved.append(device) or move(state, device)
    torch.manual_seed(0)
    trainer = _tiny_trainer(directory, model=_tiny_gpt2(), zero_offload="cpu")
    trainer.train()
    trainer.train()  # a second train() prepares again
    return moved


def test_accelerate_never_moves_the_optimizers_state(tmp_path):
    """accelerate's default device placement round-trips ``optimizer.state_dict()`` through the device: with
    offload on a GPU, the host master weights and optimizer state would land on it at ``train()``'s start
    (on CPU the move is a no-op, so the calls themselves are what is checked)."""
    for moved in run_distributed(2, _optimizer_moved_by_accelerate, str(tmp_path)):
        assert moved == []


def _fp16_trained_twice_with_model_init(rank, world_size, directory):
    """ZeroTrainer (fp16, dynamic loss scaling, as accelerate sets it up on a GPU) with ``model_init``: each
    ``train()`` builds a new model and optimizer: the loss scaling settings of both."""
    trainer = _tiny_trainer(directory, model_init=_tiny_gpt2, fp16=True)
    trainer.accelerator.native_amp = True  # accelerate's fp16 set-up on a GPU (examples/trainer.py: use_loss_scaler)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=7)
    configs = []
    for _ in range(2):
        trainer.train()
        configs.append(trainer.sharded_optimizer.loss_scaler.config)
    return configs


def test_a_second_train_with_model_init_keeps_the_grad_scalers_settings(tmp_path):
    """Trainer rebuilds the optimizer on every train() with model_init: the second one takes its loss scaling
    from the GradScaler ZeroTrainer replaced, as the first did."""
    for first, second in run_distributed(2, _fp16_trained_twice_with_model_init, str(tmp_path)):
        assert first == second and first.initial_scale == 2.0 ** 10 and first.growth_interval == 7


def _groups_per_parameter(rank, world_size, directory):
    """Per parameter name, the hyperparameters of its group: in ZeroTrainer's ShardedOptimizer and in the torch
    optimizer Trainer itself builds, over the same model (weight decay 0.1, so the two groups differ)."""
    import transformers

    torch.manual_seed(0)
    zero = _tiny_trainer(directory, arguments={"weight_decay": 0.1, "adam_beta2": 0.95}, model=_tiny_gpt2())
    plain = transformers.Trainer(model=zero.model, args=zero.args)
    both = {}
    for name, trainer in (("zero", zero), ("trainer", plain)):
        optimizer = trainer.create_optimizer()
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        optimizer = getattr(trainer, "sharded_optimizer", None) or optimizer
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        both[name] = {names[id(p)]: {k: v for k, v in group.items() if k != "params"}
                      for group in optimizer.param_groups for p in group["params"]}
    return both


def test_each_parameter_gets_the_hyperparameters_trainers_own_optimizer_gives_it(tmp_path):
    """Trainer puts biases and LayerNorm weights in a no-decay group: ZeroTrainer's groups hold each parameter
    with the weight decay (and every other hyperparameter) that Trainer's own AdamW gives it."""
    for got in run_distributed(2, _groups_per_parameter, str(tmp_path)):
        zero, trainer = got["zero"], got["trainer"]
        assert sorted(zero) == sorted(trainer)
        assert {group["weight_decay"] for group in trainer.values()} == {0.0, 0.1}
        for name, hyperparameters in trainer.items():
            assert {k: zero[name][k] for k in hyperparameters} == hyperparameters, name


def test_the_trainers_model_wrapper_keeps_the_modules_own_methods():
    """ShardedModule (what Trainer trains) answers ``buffers()`` and ``named_buffers()`` as the module does, with or
    without the buffer broadcast (its own attributes must not hide nn.Module's)."""
    from zeroimpl.integrations.trainer import ShardedModule

    module = torch.nn.BatchNorm1d(3)
    for broadcast in (True, False):
        wrapped = ShardedModule(module, broadcast_buffers=broadcast)
        assert [b is m for b, m in zip(wrapped.buffers(), module.buffers())] == [True] * 3
        assert [name for name, _ in wrapped.named_buffers()] == [f"module.{n}" for n, _ in module.named_buffers()]
