"""Sharded checkpoints: save on world size 2, resume on 1-4, across stages and offload; crash safety; errors;
conversion to and from torch's formats.

Every rank reads its slice of one fixed global batch per step (12 sequences, split evenly over 1-4 ranks), so
runs at different world sizes compute the same averaged gradient up to summation order. Tolerance where not
bitwise: PARAM_ATOL = 1e-4, the core parity tolerance (Adam turns last-bit gradient differences into up to
lr on near-zero gradients); for fp16 PARAM_RTOL_16BIT = 3e-2 in relative L2, the mixed-precision tests' bound.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed
from workloads import build_model, local_batch, param_groups, train_on_global_batch
from zeroimpl import CPUOffload, LossScaleConfig, ShardedOptimizer
from zeroimpl.checkpoint import (CheckpointError, consolidated_optimizer_state_dict, export_fp32_state_dict,
                                 load_checkpoint, load_torch_optimizer_state, save_checkpoint)
from zeroimpl.checkpoint.files import INDEX

PARAM_ATOL = 1e-4
PARAM_RTOL_16BIT = 3e-2
SAVE_AT, STEPS = 3, 5
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2}), "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
              "adagrad": (torch.optim.Adagrad, {"lr": 1e-2, "initial_accumulator_value": 0.1})}
# name -> (dtype, optimizer, save stage, save offload)
SAVED = {"adamw": (torch.float32, "adamw", 2, None), "sgd": (torch.float32, "sgd", 1, None),
         "adagrad": (torch.float32, "adagrad", 2, None), "fp16": (torch.float16, "adamw", 2, "cpu")}


def make(dtype, optimizer_name, stage, offload):
    model = build_model("gpt2", dtype)
    optimizer_class, kwargs = OPTIMIZERS[optimizer_name]
    if offload == "cpu":
        offload = CPUOffload(fused_step=False)  # the same kernel as without offload: bitwise comparable
    optimizer = ShardedOptimizer(param_groups(model), optimizer_class, stage=stage, offload=offload,
                                 bucket_numel=4096, **kwargs,
                                 loss_scale=LossScaleConfig(initial_scale=256.0, growth_interval=2)
                                 if dtype == torch.float16 else None)
    return model, optimizer


def params_of(model):
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


# -- save on 2, resume on 1-4 ------------------------------------------------------------------------
def _save_runs(rank, world_size, root):
    results = {}
    for name, (dtype, optimizer_name, stage, offload) in SAVED.items():
        model, optimizer = make(dtype, optimizer_name, stage, offload)
        train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT))
        optimizer.param_groups[1]["lr"] *= 0.5  # a hyperparameter change the checkpoint must carry
        save_checkpoint(os.path.join(root, name), optimizer, model)
        at_save = params_of(model), optimizer.loss_scale
        train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
        results[name] = {"at_save": at_save, "final": params_of(model)}
    return results


def _resume_runs(rank, world_size, root, variants, reference=True):
    """For each (saved name, stage, offload): resume from the checkpoint, and (``reference``) the uninterrupted
    reference at this world size with the same settings. At world size 4 the reference of ("adamw", 2, None)
    is saved as "saved-on-4" (for test_sharded_load_reads_only_needed_files)."""
    results = {}
    for name, stage, offload in variants:
        dtype, optimizer_name, _, _ = SAVED[name]
        model, optimizer = make(dtype, optimizer_name, stage, offload)
        load_checkpoint(os.path.join(root, name), optimizer, model)
        loaded = params_of(model), optimizer.loss_scale, optimizer.param_groups[1]["lr"]
        train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
        resumed = params_of(model)
        if not reference:
            results[(name, stage, offload)] = {"loaded": loaded, "resumed": resumed}
            continue
        model, optimizer = make(dtype, optimizer_name, stage, offload)
        train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT))
        optimizer.param_groups[1]["lr"] *= 0.5
        train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
        results[(name, stage, offload)] = {"loaded": loaded, "resumed": resumed, "reference": params_of(model)}
        if world_size == 4 and (name, stage, offload) == ("adamw", 2, None):
            save_checkpoint(os.path.join(root, "saved-on-4"), optimizer, model)
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("checkpoints"))
    return root, run_distributed(2, _save_runs, root)


# One launch per world size, in fresh processes, for everything each test below loads at that size.
SAME_SIZE_VARIANTS = [("adamw", 2, None), ("adamw", 1, "cpu"), ("sgd", 2, "cpu"), ("sgd", 1, None),
                      ("adagrad", 1, None), ("fp16", 2, "cpu"), ("fp16", 1, None)]
OTHER_SIZE_VARIANTS = [("adamw", 2, None), ("sgd", 1, "cpu"), ("adagrad", 2, None), ("fp16", 2, None)]


def _at_world_size_2(rank, world_size, root):
    # the same world size is compared with the uninterrupted run of the save launch: no reference run here
    return {"resumed": _resume_runs(rank, world_size, root, SAME_SIZE_VARIANTS, reference=False),
            "one_more_step": _one_more_step_rank(rank, world_size, root),
            "files_read": _files_read_on_load(rank, world_size, root),
            "compiled": _compiled_model_round_trip(rank, world_size, root)}


def _compiled_model_round_trip(rank, world_size, root):
    """Saved through ``torch.compile``'s wrapper (state-dict names prefixed ``_orig_mod.``; nothing is compiled
    before a forward), loaded into the bare model, and the other way round: the weights and the state come back."""
    out = {}
    for name, save_compiled in (("compiled-save", True), ("compiled-load", False)):
        model, optimizer = make(torch.float32, "adamw", 2, None)
        train_on_global_batch(model, optimizer, rank, world_size, range(2))
        save_checkpoint(os.path.join(root, name), optimizer, torch.compile(model) if save_compiled else model)
        saved_params, saved_state = params_of(model), optimizer.state_dict()
        model, optimizer = make(torch.float32, "adamw", 2, None)
        load_checkpoint(os.path.join(root, name), optimizer, model if save_compiled else torch.compile(model))
        loaded = params_of(model)
        out[name] = all(torch.equal(loaded[n], saved_params[n]) for n in saved_params) and all(
            torch.equal(a, b) for a, b in zip(_tensors(saved_state), _tensors(optimizer.state_dict())))
    return out


def _tensors(state, found=None):
    """Every tensor in a nested state dict, in order."""
    found = [] if found is None else found
    if torch.is_tensor(state):
        found.append(state)
    elif isinstance(state, dict):
        for value in state.values():
            _tensors(value, found)
    elif isinstance(state, (list, tuple)):
        for value in state:
            _tensors(value, found)
    return found


def _at_world_size_3(rank, world_size, root):
    results = {"resumed": _resume_runs(rank, world_size, root, OTHER_SIZE_VARIANTS),
               "from_torch": _from_torch_state(rank, world_size, root)}
    _reshard_and_save_again(rank, world_size, root)
    return results


@pytest.fixture(scope="module")
def at_world_size_1(saved):
    return [{"resumed": r} for r in run_distributed(1, _resume_runs, saved[0], OTHER_SIZE_VARIANTS)]


@pytest.fixture(scope="module")
def at_world_size_3(saved):
    return run_distributed(3, _at_world_size_3, saved[0])


@pytest.fixture(scope="module")
def at_world_size_4(saved):
    """Also writes "saved-on-4", which the world-size-2 launch reads."""
    return [{"resumed": r} for r in run_distributed(4, _resume_runs, saved[0], OTHER_SIZE_VARIANTS)]


@pytest.fixture(scope="module")
def at_world_size_2(saved, at_world_size_4):
    return run_distributed(2, _at_world_size_2, saved[0])


def _relative_l2(params, reference):
    diff = sum(((params[n] - reference[n]) ** 2).sum() for n in params) ** 0.5
    return (diff / sum((reference[n] ** 2).sum() for n in reference) ** 0.5).item()


def _max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_same_world_size_resumes_bitwise_across_stage_and_offload(saved, at_world_size_2):
    root, saves = saved
    for rank, results in enumerate(by_rank["resumed"] for by_rank in at_world_size_2):
        for (name, stage, offload), run in results.items():
            params, loss_scale, lr = run["loaded"]
            expected_params, expected_scale = saves[rank][name]["at_save"]
            assert all(torch.equal(params[n], expected_params[n]) for n in params), (name, stage, offload)
            assert loss_scale == expected_scale and lr == OPTIMIZERS[SAVED[name][1]][1]["lr"] * 0.5
            for n, value in saves[rank][name]["final"].items():
                assert torch.equal(run["resumed"][n], value), (name, stage, offload, n)
    assert saves[0]["fp16"]["at_save"][1] != 256.0  # the scale moved before the save, so restoring it matters


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_other_world_sizes_resume_within_parity_tolerance(request, world_size):
    launch = request.getfixturevalue(f"at_world_size_{world_size}")
    for results in (by_rank["resumed"] for by_rank in launch):
        for key, run in results.items():
            if SAVED[key[0]][0] == torch.float32:
                assert _max_diff(run["resumed"], run["reference"]) <= PARAM_ATOL, key
            else:  # fp16 rounds the weights differently once the sums differ: the mixed-precision bound
                assert _relative_l2(run["resumed"], run["reference"]) <= PARAM_RTOL_16BIT, key


# -- conversions -------------------------------------------------------------------------------------
def test_export_and_consolidated_state_reproduce_the_next_step_in_one_process(saved, at_world_size_2):
    """One process, no process group: the exported fp32 weights are the saved parameters; plain torch AdamW
    with the consolidated state, fed the same averaged gradient, takes the same next step as zeroimpl."""
    root, saves = saved
    model = build_model("gpt2")
    model.load_state_dict(export_fp32_state_dict(os.path.join(root, "adamw")))
    assert all(torch.equal(p, saves[0]["adamw"]["at_save"][0][n]) for n, p in model.named_parameters())
    optimizer = torch.optim.AdamW(param_groups(model), **OPTIMIZERS["adamw"][1])
    optimizer.load_state_dict(consolidated_optimizer_state_dict(os.path.join(root, "adamw")))
    grads = []
    for rank in range(2):  # the averaged gradient as the 2 ranks compute it: g0 / 2 + g1 / 2
        model.zero_grad()
        model(**local_batch(SAVE_AT, rank, 2)).loss.backward()
        grads.append([None if p.grad is None else p.grad * 0.5 for p in model.parameters()])
    for p, g0, g1 in zip(model.parameters(), *grads):
        p.grad = None if g0 is None else g0 + g1
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    reference = at_world_size_2[0]["one_more_step"]  # 2 ranks: load the checkpoint, one more step
    assert _max_diff(params_of(model), reference) <= 1e-6


def _one_more_step_rank(rank, world_size, root):
    model, optimizer = make(torch.float32, "adamw", 2, None)
    load_checkpoint(os.path.join(root, "adamw"), optimizer, model)
    train_on_global_batch(model, optimizer, rank, world_size, [SAVE_AT])
    return params_of(model)


def _from_torch_state(rank, world_size, root):
    """load_torch_optimizer_state(consolidated state) gives the same inner state as load_checkpoint."""
    states = []
    for route in ("checkpoint", "torch"):
        model, optimizer = make(torch.float32, "adamw", 1, None)
        if route == "checkpoint":
            load_checkpoint(os.path.join(root, "adamw"), optimizer, model)
        else:
            model.load_state_dict(export_fp32_state_dict(os.path.join(root, "adamw")))
            load_torch_optimizer_state(optimizer, consolidated_optimizer_state_dict(os.path.join(root, "adamw")))
        train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
        states.append((params_of(model), optimizer.inner.state_dict()))
    return states


def test_starting_from_a_torch_optimizer_state_matches_loading_the_checkpoint(at_world_size_3):
    for (params_a, inner_a), (params_b, inner_b) in (by_rank["from_torch"] for by_rank in at_world_size_3):
        assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)
        for index, state in inner_a["state"].items():
            assert all(torch.equal(state[k], inner_b["state"][index][k]) for k in state)


# -- reading only what is needed ---------------------------------------------------------------------
def _files_read_on_load(rank, world_size, root):
    from zeroimpl.checkpoint import files
    opened, original = [], files.read
    files.read = lambda directory, name, expected: opened.append(name) or original(directory, name, expected)
    try:
        model, optimizer = make(torch.float32, "adamw", 2, None)
        load_checkpoint(os.path.join(root, "saved-on-4"), optimizer, model)
    finally:
        files.read = original
    return sorted(n for n in opened if n.startswith("rank-"))


def test_a_compiled_models_checkpoint_loads_into_the_bare_model_and_back(at_world_size_2):
    for by_rank in at_world_size_2:
        assert by_rank["compiled"] == {"compiled-save": True, "compiled-load": True}


def test_sharded_load_reads_only_needed_files(at_world_size_2):
    opened = [by_rank["files_read"] for by_rank in at_world_size_2]  # 2 ranks load saved-on-4
    assert set(opened[0]) <= {"rank-00000.pt", "rank-00001.pt"}  # the first half of every bucket
    assert "rank-00000.pt" not in opened[1] and opened[1]


def test_command_line_export_writes_the_same_weights(saved, tmp_path):
    root, _ = saved
    output = str(tmp_path / "weights.pt")
    subprocess.run([sys.executable, "-m", "zeroimpl.checkpoint", "weights", os.path.join(root, "adamw"), output],
                   check=True, capture_output=True)
    written = torch.load(output, weights_only=True)
    expected = export_fp32_state_dict(os.path.join(root, "adamw"))
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)
    assert written["lm_head.weight"].data_ptr() == written["transformer.wte.weight"].data_ptr()  # still tied


def _reshard_and_save_again(rank, world_size, root):
    for name in ("adamw", "fp16"):
        dtype, optimizer_name, _, _ = SAVED[name]
        model, optimizer = make(dtype, optimizer_name, 1, "cpu")
        load_checkpoint(os.path.join(root, name), optimizer, model)
        save_checkpoint(os.path.join(root, f"{name}-resaved-on-{world_size}"), optimizer, model)


def test_resharding_restores_master_weights_and_state_bitwise(saved, at_world_size_3):
    """Saved on 2 ranks (stage 2), loaded on 3 (stage 1 with offload) and saved again: the full master
    weights, optimizer state, hyperparameters and loss scale are the same, bit for bit."""
    root, _ = saved  # at_world_size_3 has loaded and saved again
    for name in ("adamw", "fp16"):
        before, after = os.path.join(root, name), os.path.join(root, f"{name}-resaved-on-3")
        weights_before, weights_after = export_fp32_state_dict(before), export_fp32_state_dict(after)
        assert all(torch.equal(weights_before[k], weights_after[k]) for k in weights_before)
        state_before, state_after = consolidated_optimizer_state_dict(before), consolidated_optimizer_state_dict(after)
        assert state_before["param_groups"] == state_after["param_groups"]
        assert state_before["state"].keys() == state_after["state"].keys()
        for index, state in state_before["state"].items():
            assert state.keys() == state_after["state"][index].keys(), f"{name}: parameter {index} lost state"
            assert all(torch.equal(value, state_after["state"][index][key]) for key, value in state.items())
        scaler_before = torch.load(os.path.join(before, "index.pt"), weights_only=True)["loss_scaler"]
        scaler_after = torch.load(os.path.join(after, "index.pt"), weights_only=True)["loss_scaler"]
        assert scaler_before == scaler_after and (scaler_before is None) == (name != "fp16")


@pytest.mark.parametrize("tag, words", [("zeroimpl.checkpoint/3", "development version before 0.1.0"),
                                        ("zeroimpl.checkpoint/5", "newer zeroimpl"),
                                        ("something else", "not a zeroimpl checkpoint")])
def test_an_index_of_another_format_is_refused_naming_it(saved, tmp_path, tag, words):
    """Only the current format is read: a development format's tag, a newer one (or a foreign one) is refused by
    name, with what to do."""
    root, _ = saved
    copy = str(tmp_path / "adamw")
    shutil.copytree(os.path.join(root, "adamw"), copy)
    index = torch.load(os.path.join(copy, INDEX), weights_only=True)
    torch.save({**index, "format": tag}, os.path.join(copy, INDEX))
    with pytest.raises(CheckpointError, match=words):
        consolidated_optimizer_state_dict(copy)


# -- in process --------------------------------------------------------------------------------------------------
def test_checkpoint_functions_refuse_swapped_arguments_by_name():
    from zeroimpl.checkpoint import load_checkpoint, save_checkpoint
    model = torch.nn.Linear(2, 2)
    for function in (save_checkpoint, load_checkpoint):
        with pytest.raises(TypeError, match=r"\(directory, optimizer, model\).*got Linear and Linear"):
            function("unused", model, model)
