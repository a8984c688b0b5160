"""Resuming a DeepSpeed ZeRO-2 run on zeroimpl (issue 56 point 2): ``python -m zeroimpl.checkpoint from-deepspeed``.

Real DeepSpeed (the one the README's test command installs; ``DS_ACCELERATOR=cpu``, gloo) trains the tiny GPT-2 of
tests/workloads.py (two param groups, a frozen parameter, tied embeddings) with ZeRO-2 and torch's AdamW (lr 1e-2,
clipping at 1.0) on 2 CPU ranks for 4 steps, saves with ``engine.save_checkpoint``, and continues 4 steps from that
checkpoint in fresh processes: the reference. The converted checkpoint (the CLI, in a process of its own) loads:

* at 2 ranks, stage 2: the parameters bitwise DeepSpeed's at the save, and 4 more steps bitwise DeepSpeed's;
* at 3 ranks, stage 1: the parameters bitwise, 4 more steps within PARAM_ATOL = 1e-4 (another summation order,
  which Adam turns into up to lr on near-zero gradients) both of DeepSpeed's resume at 2 ranks and of DeepSpeed
  itself resumed at 3 ranks from the universal format.

At AdamW's default lr (DEFAULT_LR, 1e-3) zeroimpl resumes at 3 ranks within ACROSS_SIZES_ATOL = 1e-5 of DeepSpeed
going on (from torch's AdamW at 2 ranks, and from DeepSpeed's own CPU Adam at 3).

The same checkpoint in DeepSpeed's universal format (``ds_to_universal.py``, one folder per parameter) converts to
the same training: 4 steps bitwise DeepSpeed's at 2 ranks. Two more DeepSpeed runs save at step 4 and go on to step 8
in the same processes (the reference: what DeepSpeed continues from the state it saved):

* bf16 ZeRO-2 at 2 ranks (``bf16_zero_pp_rank_*`` files): zeroimpl with bf16 parameters and ``reduce_dtype=bf16``
  (DeepSpeed reduces bf16 gradients in bf16) continues bitwise DeepSpeed's;
* ZeRO-2 with ``offload_optimizer`` (DeepSpeed's own Adam, DeepSpeedCPUAdam) at 3 data-parallel ranks: zeroimpl
  (torch's AdamW) continues at 3 ranks within PARAM_ATOL (DeepSpeed's Adam kernel is not torch's);
* fp16 ZeRO-2 at 2 ranks with dynamic loss scaling (a window of 3 steps: the scale grows at steps 3 and 6):
  zeroimpl continues with fp16 parameters, ``reduce_dtype=fp16`` and the converted loss scale. Its scale is
  DeepSpeed's after every step, and its parameters are bitwise DeepSpeed's after steps 4 and 5. At step 6 they
  part: DeepSpeed 0.19.8 (``stage_1_and_2.py``, ``step``) updates the loss scale before it unscales the gradients,
  so on a step where the scale grows it divides them by the grown scale, half the one they were scaled by;
  zeroimpl unscales by the scale the loss was multiplied with. After step 7 they are within FP16_ATOL. This
  machine's CPU lacks native fp16, which DeepSpeed's CPU accelerator asks for before it allows fp16; the run tells
  it fp16 is supported (torch computes fp16 on the CPU regardless), and DeepSpeed runs as it would on a device that
  has it.

The converted fp32 weights of the fp32 and bf16 checkpoints are what DeepSpeed's own ``zero_to_fp32`` reads from the
same files, bitwise. Adam or AdamW is read from the saved config, or torch's groups. Refused by name, before anything
is written: tensor parallelism (an ``mp_rank_01`` file, or a universal folder whose parameters are larger than the
saved shapes), pipeline parallelism (``layer_*`` files), a ``latest`` that names a missing tag, ZeRO stage 3, an
optimizer other than Adam or AdamW, ``elastic_checkpoint`` (not carried yet), an Adam that tells neither AdamW nor
Adam, and a call from inside a training job's process group.
"""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed
from workloads import build_model, local_batch, max_param_diff, param_groups, train_on_global_batch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is not installed (the README's test command installs it)")

SAVE_AT, STEPS, LR = 4, 8, 1e-2
PARAM_ATOL = 1e-4
# AdamW's own default learning rate, where a resume at another world size stays within the 1e-5 of
# DeepSpeed's own (at LR, 3 ranks' summation order alone moves DeepSpeed itself by 4.7e-5)
DEFAULT_LR, ACROSS_SIZES_ATOL = 1e-3, 1e-5
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3}
FP16_ATOL = 1e-2  # = LR: DeepSpeed's step 6 applies half the gradient, which Adam turns into up to a third of LR
DEEPSPEED = {"DS_ACCELERATOR": "cpu"}


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _engine(world_size, offload=False, lr=LR, **extra):
    """DeepSpeed ZeRO-2 with torch's AdamW (``torch_adam``), or with ``offload`` DeepSpeed's own CPU Adam."""
    import deepspeed

    if "fp16" in extra:  # (see the module docstring)
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True

    model = build_model("gpt2", torch.float32)
    zero = {"stage": 2, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = {**extra, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "train_batch_size": world_size, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.99], "eps": 1e-8,
                                                        "weight_decay": 0.1, "torch_adam": not offload}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    return model, engine


def _train(engine, rank, world_size, steps):
    """DeepSpeed's parameters and loss scale after each step."""
    after = []
    for step in steps:
        engine.backward(engine(**local_batch(step, rank, world_size)).loss)
        engine.step()
        after.append((_params(engine.module), float(engine.optimizer.loss_scale)))
    return after


def _deepspeed_saves(rank, world_size, root, extra=None, go_on=False):
    """DeepSpeed's parameters at the save (step 4), and with ``go_on`` also its parameters and loss scale after each
    later step, trained on in the same processes."""
    model, engine = _engine(world_size, **(extra or {}))
    _train(engine, rank, world_size, range(SAVE_AT))
    engine.save_checkpoint(root, tag="step4")
    at_save = _params(model)
    if not go_on:
        return at_save
    return at_save, _train(engine, rank, world_size, range(SAVE_AT, STEPS))


def _deepspeed_continues(rank, world_size, root, universal=False):
    """DeepSpeed resumed from its checkpoint in fresh processes (``universal``: from the universal folder that
    ``latest_universal`` in ``root`` names, at any world size): its parameters loaded, and after 4 more steps."""
    model, engine = _engine(world_size, **({"checkpoint": {"load_universal": True}} if universal else {}))
    engine.load_checkpoint(root)
    loaded = _params(model)
    _train(engine, rank, world_size, range(SAVE_AT, STEPS))
    return loaded, _params(model)


def _zeroimpl_continues(rank, world_size, runs, lr=LR):
    """Per ``(converted checkpoint, stage, dtype)`` of ``runs``: zeroimpl's parameters loaded, and its parameters
    and loss scale after each of 4 more steps (fp16: scaled as the DeepSpeed run's config says). 16-bit parameters
    reduce in their dtype, as DeepSpeed does."""
    from zeroimpl import LossScaleConfig, ShardedOptimizer
    from zeroimpl.checkpoint import load_checkpoint

    results = []
    for converted, stage, dtype in runs:
        model = build_model("gpt2", dtype)
        scaling = LossScaleConfig(initial_scale=2.0 ** FP16["initial_scale_power"],
                                  growth_interval=FP16["loss_scale_window"]) if dtype == torch.float16 else None
        optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, lr=lr,
                                     reduce_dtype=None if dtype == torch.float32 else dtype, loss_scale=scaling)
        load_checkpoint(converted, optimizer, model)
        loaded, after = _params(model), []
        for step in range(SAVE_AT, STEPS):
            train_on_global_batch(model, optimizer, rank, world_size, [step])
            after.append((_params(model), optimizer.loss_scale))
        results.append((loaded, after))
    return results


def _convert(saved: str, converted: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zeroimpl.checkpoint", "from-deepspeed", saved, converted],
                          capture_output=True, text=True, timeout=300)


def _deepspeeds_own_fp32(rank, world_size, saved: list[str]):
    """DeepSpeed's own reader (zero_to_fp32) of each checkpoint: the full fp32 weights."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return [dict(get_fp32_state_dict_from_zero_checkpoint(path)) for path in saved]


def _universal(saved: str, universal: str) -> None:
    """DeepSpeed's own ds_to_universal.py on the saved tag folder."""
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           os.path.join(saved, "step4"), "--output_folder", universal, "--inject_missing_state"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **DEEPSPEED})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def default_lr_runs(tmp_path_factory):
    """At DEFAULT_LR: DeepSpeed ZeRO-2 with torch's AdamW at 2 ranks, and with its own CPU Adam (offload) at 3,
    each saving at step 4 and going on to step 8; both converted and continued on zeroimpl at 3 ranks (stage 2)."""
    root = tmp_path_factory.mktemp("deepspeed-default-lr")
    saved, offload_saved = str(root / "torch-adam"), str(root / "cpu-adam")
    torch_adam = run_distributed(2, _deepspeed_saves, saved, {"lr": DEFAULT_LR}, True, env=DEEPSPEED)[0]
    cpu_adam = run_distributed(3, _deepspeed_saves, offload_saved, {"offload": True, "lr": DEFAULT_LR}, True,
                               env=DEEPSPEED)[0]
    for source in (saved, offload_saved):
        done = _convert(source, source + "-converted")
        assert done.returncode == 0, done.stderr[-3000:]
    at_3 = run_distributed(3, _zeroimpl_continues, [(saved + "-converted", 2, torch.float32),
                                                    (offload_saved + "-converted", 2, torch.float32)], DEFAULT_LR)
    return {"torch adam": torch_adam, "cpu adam": cpu_adam, "at 3": at_3}


def test_at_adamws_default_lr_a_resume_at_3_ranks_is_within_1e_5_of_deepspeed_going_on(default_lr_runs):
    """From DeepSpeed with torch's AdamW (2 ranks; measured 7.5e-7) and with its own CPU Adam (3 ranks, offload;
    measured 4.6e-7), zeroimpl at 3 ranks (torch's AdamW) ends within 1e-5 of DeepSpeed going on to step 8."""
    for converted, theirs in ((0, default_lr_runs["torch adam"]), (1, default_lr_runs["cpu adam"])):
        at_save, after = theirs
        for rank in default_lr_runs["at 3"]:
            loaded, ours = rank[converted]
            assert max_param_diff(loaded, at_save) == 0.0
            far = max_param_diff(ours[-1][0], after[-1][0])
            assert far <= ACROSS_SIZES_ATOL, (converted, far)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed")
    saved, bf16_saved, offload_saved = str(root / "deepspeed"), str(root / "deepspeed-bf16"), str(root / "offload")
    fp16_saved = str(root / "deepspeed-fp16")
    universal = str(root / "universal")
    at_save = run_distributed(2, _deepspeed_saves, saved, env=DEEPSPEED)[0]
    reference = run_distributed(2, _deepspeed_continues, saved, env=DEEPSPEED)[0][1]
    bf16 = run_distributed(2, _deepspeed_saves, bf16_saved, {"bf16": {"enabled": True}}, True, env=DEEPSPEED)[0]
    offload = run_distributed(3, _deepspeed_saves, offload_saved, {"offload": True}, True, env=DEEPSPEED)[0]
    fp16 = run_distributed(2, _deepspeed_saves, fp16_saved, {"fp16": FP16}, True, env=DEEPSPEED)[0]
    _universal(saved, universal)
    deepspeed_at_3 = run_distributed(3, _deepspeed_continues, str(root), True, env=DEEPSPEED)[0]
    converted = {}
    for source in (saved, bf16_saved, offload_saved, fp16_saved, universal):
        converted[source] = source + "-converted"
        # (the universal folder through its parent's latest_universal, which ds_to_universal.py wrote)
        done = _convert(str(root) if source == universal else source, converted[source])
        assert done.returncode == 0, done.stderr[-3000:]
    at_2 = run_distributed(2, _zeroimpl_continues, [(converted[saved], 2, torch.float32),
                                                    (converted[universal], 2, torch.float32),
                                                    (converted[bf16_saved], 2, torch.bfloat16),
                                                    (converted[fp16_saved], 2, torch.float16)])
    at_3 = run_distributed(3, _zeroimpl_continues, [(converted[saved], 1, torch.float32),
                                                    (converted[offload_saved], 2, torch.float32)])
    return {"saved": saved, "universal": universal, "at save": at_save, "reference": reference, "bf16": bf16,
            "offload": offload, "fp16": fp16, "deepspeed at 3": deepspeed_at_3,
            "deepspeed's fp32": run_distributed(1, _deepspeeds_own_fp32, [saved, bf16_saved], env=DEEPSPEED)[0],
            "converted": [converted[saved], converted[bf16_saved]],
            "at 2": [rank[0] for rank in at_2], "universal at 2": [rank[1] for rank in at_2],
            "bf16 at 2": [rank[2] for rank in at_2], "fp16 at 2": [rank[3] for rank in at_2],
            "at 3": [rank[0] for rank in at_3], "offload at 3": [rank[1] for rank in at_3]}


def test_a_converted_zero2_checkpoint_continues_bitwise_at_2_ranks(runs):
    for loaded, after in runs["at 2"]:
        assert max_param_diff(loaded, runs["at save"]) == 0.0
        assert max_param_diff(after[-1][0], runs["reference"]) == 0.0


def test_a_converted_zero2_checkpoint_continues_at_3_ranks(runs):
    for loaded, after in runs["at 3"]:
        assert max_param_diff(loaded, runs["at save"]) == 0.0
        assert max_param_diff(after[-1][0], runs["reference"]) <= PARAM_ATOL


def test_a_converted_fp16_checkpoint_continues_with_deepspeeds_loss_scale(runs):
    """The loss scale at the save (512: 256 grown at step 3) and its counters carry over: zeroimpl's scale after
    each later step is DeepSpeed's (it grows at step 6 in both). Bitwise until DeepSpeed's step 6 unscales by the
    grown scale (see the module docstring)."""
    at_save, theirs = runs["fp16"]
    for loaded, ours in runs["fp16 at 2"]:
        assert all(p.dtype == torch.float16 for p in ours[-1][0].values())
        assert max_param_diff(loaded, at_save) == 0.0
        assert [scale for _, scale in ours] == [scale for _, scale in theirs] == [512.0, 512.0, 1024.0, 1024.0]
        assert [max_param_diff(a, b) == 0.0 for (a, _), (b, _) in zip(ours, theirs)] == [True, True, False, False]
        assert max_param_diff(ours[-1][0], theirs[-1][0]) <= FP16_ATOL


def test_at_3_ranks_it_stays_within_tolerance_of_deepspeed_itself_resumed_at_3(runs):
    """DeepSpeed resumes the universal folder at 3 ranks (loaded bitwise); zeroimpl at 3 ranks (stage 1) from the
    converted checkpoint stays within PARAM_ATOL of it: the two sum each gradient over 3 ranks in other orders."""
    loaded, theirs = runs["deepspeed at 3"]
    assert max_param_diff(loaded, runs["at save"]) == 0.0
    for _, ours in runs["at 3"]:
        assert max_param_diff(ours[-1][0], theirs) <= PARAM_ATOL


def test_the_universal_format_converts_to_the_same_training(runs):
    """ds_to_universal.py's folder per parameter (named by the latest_universal file it writes beside it): loaded
    bitwise, and 4 steps bitwise DeepSpeed's own resume."""
    for loaded, after in runs["universal at 2"]:
        assert max_param_diff(loaded, runs["at save"]) == 0.0
        assert max_param_diff(after[-1][0], runs["reference"]) == 0.0


def test_a_converted_bf16_checkpoint_continues_bitwise_in_bf16(runs):
    at_save, theirs = runs["bf16"]
    for loaded, ours in runs["bf16 at 2"]:
        assert all(p.dtype == torch.bfloat16 for p in ours[-1][0].values())
        assert max_param_diff(loaded, at_save) == 0.0
        assert max_param_diff(ours[-1][0], theirs[-1][0]) == 0.0


def test_an_offloaded_checkpoint_of_3_ranks_continues_within_tolerance(runs):
    """offload_optimizer: DeepSpeed's own CPU Adam at 3 data-parallel ranks, then torch's AdamW on zeroimpl."""
    at_save, theirs = runs["offload"]
    for loaded, ours in runs["offload at 3"]:
        assert max_param_diff(loaded, at_save) == 0.0
        assert 0.0 < max_param_diff(ours[-1][0], theirs[-1][0]) <= PARAM_ATOL  # (the kernels differ: not bitwise)


def test_the_converted_fp32_weights_are_deepspeeds_own_reading_bitwise(runs):
    """fp32 and bf16 ZeRO-2 (whose files DeepSpeed names bf16_zero_pp_rank_*): the converted checkpoint's fp32 weights
    are what DeepSpeed's own zero_to_fp32 reads from the same files, bitwise (tied names included)."""
    from zeroimpl.checkpoint import export_fp32_state_dict

    for converted, theirs in zip(runs["converted"], runs["deepspeed's fp32"]):
        ours = export_fp32_state_dict(converted)
        trainable = {name for name in theirs if name in ours}
        assert len(trainable) == len(theirs) and all(torch.equal(ours[name], theirs[name]) for name in trainable)


def _refusal(ds_dir) -> str:
    from zeroimpl.checkpoint import CheckpointError
    from zeroimpl.checkpoint.deepspeed import from_deepspeed

    with pytest.raises(CheckpointError) as raised:
        from_deepspeed(str(ds_dir), str(ds_dir) + "-converted")
    assert not os.path.exists(str(ds_dir) + "-converted")
    return str(raised.value)


def _copy(runs, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(runs["saved"], "step4"), copy)
    return copy


def test_tensor_and_pipeline_parallel_checkpoints_are_refused_by_name(runs, tmp_path):
    copy = _copy(runs, tmp_path)
    shutil.copy(copy / "zero_pp_rank_0_mp_rank_00_optim_states.pt", copy / "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    assert "tensor parallelism" in _refusal(copy)
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "layer_01-model_states.pt").write_bytes(b"")
    assert "pipeline-parallel" in _refusal(pipeline)
    (pipeline / "latest").write_text("global_step9")
    assert "names the tag 'global_step9'" in _refusal(pipeline)


def test_a_universal_folder_of_other_parallelism_is_refused_by_name(runs, tmp_path):
    """A parameter larger than the saved shape (merged from tensor-parallel ranks), a parameter folder that the model
    states do not name (another pipeline stage's), and a trainable parameter without its folder."""
    name = "transformer.h.0.mlp.c_fc.weight"
    merged = tmp_path / "merged"
    shutil.copytree(runs["universal"], merged)
    saved = torch.load(merged / "zero" / name / "fp32.pt", weights_only=True)
    torch.save({**saved, "param": torch.cat([saved["param"]] * 2, dim=1)}, merged / "zero" / name / "fp32.pt")
    assert "merged from tensor-parallel ranks" in _refusal(merged)
    other_stage = tmp_path / "other_stage"
    shutil.copytree(runs["universal"], other_stage)
    shutil.copytree(other_stage / "zero" / name, other_stage / "zero" / "transformer.h.2.mlp.c_fc.weight")
    assert "['transformer.h.2.mlp.c_fc.weight'] that mp_rank_00_model_states.pt does not name" in _refusal(other_stage)
    missing = tmp_path / "missing"
    shutil.copytree(runs["universal"], missing)
    shutil.rmtree(missing / "zero" / name)
    assert f"misses ['{name}']" in _refusal(missing)


def test_a_universal_folder_of_zero1_with_a_frozen_parameter_converts(runs, tmp_path):
    """ZeRO-1 saves no frozen_param_shapes (DeepSpeed writes them only where gradients are partitioned), while
    ds_to_universal.py still writes the frozen parameter's folder: it converts as the ZeRO-2 folder does."""
    from zeroimpl.checkpoint import export_fp32_state_dict
    from zeroimpl.checkpoint.deepspeed import MODEL_STATES, _read

    zero1 = tmp_path / "zero1"
    shutil.copytree(runs["universal"], zero1)
    model_states = _read(str(zero1 / MODEL_STATES))
    torch.save({**model_states, "frozen_param_shapes": None}, zero1 / MODEL_STATES)
    done = _convert(str(zero1), str(tmp_path / "converted"))
    assert done.returncode == 0, done.stderr[-3000:]
    ours, reference = export_fp32_state_dict(str(tmp_path / "converted")), export_fp32_state_dict(runs["converted"][0])
    assert ours.keys() == reference.keys() and all(torch.equal(ours[n], reference[n]) for n in ours)


def test_a_stale_latest_gives_way_to_latest_universal(runs, tmp_path):
    """A parent whose latest names a tag since deleted, and whose latest_universal names the universal folder."""
    parent = tmp_path / "parent"
    shutil.copytree(runs["universal"], parent / "step4_universal")
    (parent / "latest").write_text("global_step4")
    (parent / "latest_universal").write_text("step4_universal")
    done = _convert(str(parent), str(tmp_path / "converted"))
    assert done.returncode == 0, done.stderr[-3000:]


def _deepspeeds_scaler_against_zeroimpls(rank, world_size):
    """Per (window, hysteresis, overflows before the save, overflows after): DeepSpeed's own DynamicLossScaler run
    through the steps before a save, converted (``_loss_scale``) into zeroimpl's scaler, and both run on through
    the steps after; their scales after each later step."""
    import itertools

    import deepspeed
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler as DeepSpeeds

    from zeroimpl.checkpoint.deepspeed import _loss_scale
    from zeroimpl.precision import DynamicLossScaler

    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for window, hysteresis, before_length in itertools.product((1, 2, 3), (1, 2, 3), range(5)):
        for before in itertools.product((False, True), repeat=before_length):
            for after in itertools.product((False, True), repeat=6):
                theirs = DeepSpeeds(init_scale=2.0 ** 12, scale_window=window, min_scale=1,
                                    delayed_shift=hysteresis, consecutive_hysteresis=False,
                                    raise_error_at_min_scale=False)
                for overflow in before:
                    theirs.update_scale(overflow)
                config, state = _loss_scale({"loss_scaler": theirs}, {"skipped_steps": sum(before)})
                ours = DynamicLossScaler(config)
                ours.load_state_dict(state)
                scales = []
                for overflow in after:
                    theirs.update_scale(overflow)
                    ours.update(overflow)
                    scales.append((theirs.cur_scale, ours.scale))
                results.append(((window, hysteresis, before, after), scales))
    return results


def test_the_converted_loss_scale_grows_and_backs_off_at_deepspeeds_steps():
    """Every save point of up to 4 steps, windows 1-3 and hysteresis 1-3, then 6 more steps of every overflow
    pattern: zeroimpl's scale is DeepSpeed's at every step, or, after a later overflow, until a window of clean
    steps has passed (zeroimpl then grows, DeepSpeed one clean step later)."""
    for (window, hysteresis, before, after), scales in run_distributed(1, _deepspeeds_scaler_against_zeroimpls,
                                                                       env=DEEPSPEED)[0]:
        if True in after:
            first = after.index(True)
            scales = scales[:first + window]
        assert [theirs for theirs, _ in scales] == [ours for _, ours in scales], (window, hysteresis, before, after)


def _edited(copy, change_rank_state=None, change_config=None):
    """The copied checkpoint with each rank's optimizer state and the saved DeepSpeed config changed (DeepSpeed's
    own objects taken out of the files, so that torch.save can write them)."""
    from zeroimpl.checkpoint.deepspeed import MODEL_STATES, _read

    for rank in range(2):
        path = copy / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        saved = _read(str(path))
        state = saved["optimizer_state_dict"]
        state.update(loss_scaler=None, param_slice_mappings=None, zero_stage=2)
        if change_rank_state:
            change_rank_state(state)
        torch.save(saved, path)
    model_states = _read(str(copy / MODEL_STATES))
    if change_config:
        model_states["ds_config"] = change_config(model_states["ds_config"])
    torch.save(model_states, copy / MODEL_STATES)
    return copy


def _momentum(state):
    for per_group in state["base_optimizer_state"]["state"].values():
        per_group["momentum_buffer"] = per_group.pop("exp_avg")


def _fused_adams_groups(state):  # DeepSpeed's FusedAdam and CPU Adam: bias_correction, no decoupled_weight_decay
    for group in state["base_optimizer_state"]["param_groups"]:
        group.pop("decoupled_weight_decay")
        group["bias_correction"] = True


def _loss_scaler(static: bool):
    """DeepSpeed's own loss scaler: a static scale of 128, or a dynamic one with consecutive_hysteresis."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    def change(state):
        state["loss_scaler"] = LossScaler(scale=128) if static else DynamicLossScaler(
            init_scale=512, scale_window=3, min_scale=1, delayed_shift=2, consecutive_hysteresis=True)
    return change


EDITS = {
    "stage 3": (lambda state: state.update(zero_stage=3), None, "ZeRO stage 3"),
    "momentum": (_momentum, None, "only Adam and AdamW"),
    "elastic_checkpoint": (lambda state: state.update(base_optimizer_state=[state["base_optimizer_state"]]), None,
                           "elastic_checkpoint"),
    "FusedAdam's groups, no config": (_fused_adams_groups, lambda config: None, "neither in its DeepSpeed config"),
    "Lamb": (None, lambda config: {**config, "optimizer": {"type": "Lamb", "params": {}}}, "'Lamb'"),
    "static loss scale": (_loss_scaler(static=True), None, "a static fp16 loss scale"),
    "consecutive_hysteresis": (_loss_scaler(static=False), None, "(consecutive_hysteresis)"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_what_does_not_convert_is_refused_by_name(runs, tmp_path, edit):
    """Stage 3, other optimizers (by their state or their config), elastic_checkpoint's per-group state, an Adam that
    tells neither AdamW nor Adam (FusedAdam's groups, a config not saved), and fp16 loss scalers that zeroimpl's
    cannot continue (a static scale, consecutive_hysteresis)."""
    change_state, change_config, named = EDITS[edit]
    assert named in _refusal(_edited(_copy(runs, tmp_path), change_state, change_config))


@pytest.mark.parametrize("config, groups, expected", [
    ({"type": "Adam", "params": {"adam_w_mode": False}}, _fused_adams_groups, "torch.optim.adam.Adam"),
    ({"type": "Adam", "params": {}}, _fused_adams_groups, "torch.optim.adamw.AdamW"),
    (None, None, "torch.optim.adamw.AdamW")])
def test_adam_or_adamw_is_read_from_the_config_or_torchs_groups(runs, tmp_path, config, groups, expected):
    """DeepSpeed's "Adam" is AdamW unless adam_w_mode is off; without a saved config (a client optimizer, a config
    passed as a path) torch's groups say it; FusedAdam's extra bias_correction is dropped."""
    copy = _edited(_copy(runs, tmp_path), groups,
                   (lambda saved: {**saved, "optimizer": config}) if config else (lambda saved: "ds_config.json"))
    done = _convert(str(copy), str(tmp_path / "converted"))
    assert done.returncode == 0, done.stderr[-3000:]
    index = torch.load(tmp_path / "converted" / "index.pt", weights_only=True)
    assert index["optimizer_classes"] == [expected, expected]


def _inside_a_job(rank, world_size, saved):
    from zeroimpl.checkpoint import CheckpointError
    from zeroimpl.checkpoint.deepspeed import from_deepspeed

    try:
        from_deepspeed(saved, saved + "-converted")
    except CheckpointError as error:
        return str(error)
    return None


def test_a_conversion_inside_a_training_job_is_refused(runs):
    assert "python -m zeroimpl.checkpoint from-deepspeed" in run_distributed(1, _inside_a_job, runs["saved"])[0]
