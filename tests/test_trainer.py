"""Hugging Face Trainer + ZeroTrainer under torchrun (2 ranks, gloo): parity with Trainer + DDP + AdamW,
sharded checkpoints and resume on the same and on another world size.

Tolerances: Trainer logs losses rounded to 4 digits (so losses are compared to 1e-4); parameters within
PARAM_ATOL = 1e-4, the core parity tolerance (tests/test_parity.py), since clipping computes the global norm
from shards in another summation order. Runs: tiny GPT-2 (2 layers, width 128), 6 steps, 2 micro-batches
per step, max_grad_norm 1.0, linear schedule with warm-up.
"""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAM_ATOL = 1e-4
STEPS = 6


def torchrun(tmp_path, name, *flags, nproc=2):
    dump = str(tmp_path / f"{name}.pt")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               os.path.join(ROOT, "examples", "trainer.py"), "--steps", str(STEPS), "--accum", "2",
               "--output-dir", str(tmp_path / name), "--dump", dump, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    return torch.load(dump, weights_only=True), completed.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("trainer")
    results = {"ddp": torchrun(tmp_path, "ddp", "--plugin", "none")}
    for stage in (1, 2):
        results[f"stage{stage}"] = torchrun(tmp_path, f"stage{stage}", "--stage", str(stage), "--save-steps", "3")
    checkpoint = str(tmp_path / "stage2" / "checkpoint-3")
    results["resumed"] = torchrun(tmp_path, "resumed", "--stage", "2", "--resume", checkpoint)
    results["resumed_on_1"] = torchrun(tmp_path, "resumed_on_1", "--stage", "2", "--resume", checkpoint, nproc=1)
    results["checkpoint_files"] = sorted(os.listdir(os.path.join(checkpoint, "zeroimpl")))
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


def test_resume_on_one_rank_continues_from_the_checkpoint(runs):
    resumed, _ = runs["resumed_on_1"]
    uninterrupted, _ = runs["stage2"]
    assert resumed["step"] == STEPS and resumed["losses"][:3] == uninterrupted["losses"][:3]
    assert all(torch.isfinite(p).all() for p in resumed["params"].values())


@pytest.mark.parametrize("setting", [{"deepspeed": {"zero_optimization": {"stage": 2}}}, {"fsdp": "full_shard"},
                                     {"fp16": True}])
def test_conflicting_training_arguments_are_refused(tmp_path, setting):
    """Checked before Trainer builds anything, so no process group or accelerator is needed."""
    import transformers

    from integrations.trainer import check_training_arguments

    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    for key, value in setting.items():
        object.__setattr__(arguments, key, value)  # TrainingArguments would start DeepSpeed / FSDP itself
    with pytest.raises(ValueError, match="ZeroTrainer"):
        check_training_arguments(arguments)
