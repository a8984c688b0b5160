"""A DeepSpeed ZeRO stage 1 or 2 checkpoint converted into a zeroimpl checkpoint: :func:`from_deepspeed`.

What DeepSpeed 0.19 writes for ZeRO-1/2 (per tag folder; a ``latest`` file beside the tags names the newest):

* ``mp_rank_00_model_states.pt``: ``module`` (the model's state dict, in the training dtype), ``param_shapes`` (per
  param group, the trainable parameters' names and shapes, in the order of the group's flat buffer),
  ``frozen_param_shapes``, ``shared_params`` (a tied name -> the name it shares) and ``buffer_names``;
* ``{bf16_,}zero_pp_rank_<dp>_mp_rank_00_optim_states.pt`` per data-parallel rank: ``optimizer_state_dict`` with
  ``single_partition_of_fp32_groups`` (per group, this rank's range of the group's flat fp32 master, padding
  removed), ``base_optimizer_state`` (the torch optimizer's state dict over the ranks' flat partitions: per group
  ``exp_avg``, ``exp_avg_sq`` over the same range, padding kept, and ``step``; its ``param_groups``' hyperparameters),
  ``param_alignment_paddings``, ``zero_stage`` and ``partition_count``.

A group's flat vector is its ranks' partitions in rank order; its parameters follow in ``param_shapes`` order, each
followed by its alignment padding (DeepSpeed's own ``zero_to_fp32.py`` reads them so). With ``offload_optimizer``
the files are the same, with DeepSpeedCPUAdam's state (the same three keys) in ``base_optimizer_state``.

DeepSpeed's universal format (what ``ds_to_universal.py`` writes) holds the same in one folder per parameter:
``mp_rank_00_model_states.pt`` as above, ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` (each ``{"param": the whole
tensor, "cat_dim": ...}``) and ``zero/<name>/step.pt`` for each trainable parameter (frozen and tied ones have
``fp32.pt`` alone), and ``zero/optimizer_state.pt`` with the ``param_groups``, ``zero_stage`` and ``loss_scaler``.

The files pickle three DeepSpeed classes (the loss scaler, the stage enum, a fragment address): they are read with
``torch.load(weights_only=True)`` and stand-ins of those classes, so DeepSpeed need not be installed and a crafted
file cannot run code.

The conversion takes one process and no GPU: it builds a stand-in of the model from the saved names (tied
parameters tied), a ShardedOptimizer of the same optimizer class and param groups over it at world size 1 (a
process group of its own), loads the state into it and saves it with :func:`save_checkpoint`; the result loads at
any world size, stage or offload setting as any zeroimpl checkpoint.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from ..optimizer import ShardedOptimizer
from ..precision import LossScaleConfig
from ..state_format import CheckpointError
from .api import save_checkpoint
from .convert import load_torch_optimizer_state

MODEL_STATES = "mp_rank_00_model_states.pt"
UNIVERSAL = "zero"  # the universal format's folder of per-parameter folders, beside MODEL_STATES
_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ADAM_KEYS = {"exp_avg", "exp_avg_sq", "step"}


def from_deepspeed(ds_dir: str, out_dir: str) -> None:
    """Convert the DeepSpeed ZeRO-1/2 checkpoint in ``ds_dir`` (a tag folder, ``ds_to_universal.py``'s, or their
    parent, whose ``latest``, else ``latest_universal``, names one) to a zeroimpl one at ``out_dir``. Run it in one
    process, outside the training job.

    Carried: fp32 masters, Adam's moments and steps, param groups, frozen parameters, buffers, the dynamic fp16 loss
    scale; from fp32, bf16 or fp16, with or without ``offload_optimizer``, any data-parallel degree; as torch's Adam
    or AdamW, as the config (else the param groups) says. ``CheckpointError``: tensor or pipeline parallelism, stage
    3, other optimizers, Adam without bias correction or not saying which, a static fp16 loss scale,
    ``consecutive_hysteresis``, ``elastic_checkpoint``, BF16_Optimizer's state."""
    if dist.is_available() and dist.is_initialized():
        raise CheckpointError("from_deepspeed converts in one process, with a process group of its own: run it "
                              "outside the training job (python -m zeroimpl.checkpoint from-deepspeed DS_DIR OUT_DIR)")
    tag = _tag_folder(ds_dir)
    model_states = _read(os.path.join(tag, MODEL_STATES))
    common, saved_groups, by_name = _saved_state(tag, model_states)
    groups, stand_in, state, optimizer_class = _converted(model_states, saved_groups, by_name)
    scaling = _loss_scale(common, model_states)
    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(rendezvous, 'store')}", rank=0,
                                world_size=1)
        try:
            optimizer = ShardedOptimizer(groups, optimizer_class, stage=2, loss_scale=scaling and scaling[0])
            load_torch_optimizer_state(optimizer, state)
            if scaling is not None:
                optimizer.loss_scaler.load_state_dict(scaling[1])
            save_checkpoint(out_dir, optimizer, stand_in)
        finally:
            dist.destroy_process_group()


def _saved_state(tag: str, model_states: dict) -> tuple[dict, list[dict], dict[str, SavedParam]]:
    """(the state every rank shares: stage, loss scaler; the saved torch param groups; each trainable parameter's
    state by name), from the universal format's folders or the per-rank files; refusing what does not convert."""
    if os.path.isdir(os.path.join(tag, UNIVERSAL)):
        common = _read(os.path.join(tag, UNIVERSAL, "optimizer_state.pt"))
        _check_source(common)
        return common, common.get("param_groups"), _universal_state(tag, model_states)
    ranks = [_read(path)["optimizer_state_dict"] for path in _rank_files(tag)]
    common = ranks[0]
    _check_source(common)
    if not isinstance(common.get("base_optimizer_state"), dict):
        raise CheckpointError("the checkpoint was saved with elastic_checkpoint (its optimizer state is per group, "
                              "without param groups), which this conversion does not read yet")
    return common, common["base_optimizer_state"]["param_groups"], _partitioned_state(model_states, ranks)


def _tag_folder(ds_dir: str) -> str:
    if os.path.isfile(os.path.join(ds_dir, MODEL_STATES)):
        return ds_dir
    stale = []
    for pointer in ("latest", "latest_universal"):  # (ds_to_universal.py writes the second beside its folder)
        latest = os.path.join(ds_dir, pointer)
        if os.path.isfile(latest):
            with open(latest) as handle:
                tag = os.path.join(ds_dir, handle.read().strip())
            if os.path.isfile(os.path.join(tag, MODEL_STATES)):
                return tag
            stale.append(f"{latest} names the tag {os.path.basename(tag)!r}, which has no {MODEL_STATES}")
    if stale:
        raise CheckpointError("; ".join(stale))
    if glob.glob(os.path.join(ds_dir, "layer_*-model_states.pt")):
        raise CheckpointError(f"{ds_dir!r} is a DeepSpeed pipeline-parallel checkpoint (layer_*-model_states.pt): "
                              "only data-parallel ZeRO-1/2 checkpoints convert")
    raise CheckpointError(f"{ds_dir!r} is not a DeepSpeed checkpoint: no {MODEL_STATES} in it, and no 'latest' (or "
                          "'latest_universal') file naming a folder that has one")


def _rank_files(tag: str) -> list[str]:
    """The per-rank optimizer files, in data-parallel rank order; refusing tensor parallelism and missing ranks."""
    found = {}
    for name in os.listdir(tag):
        match = _RANK_FILE.match(name)  # ("bf16_" whenever bf16 is on: told apart by what the file holds)
        if match:
            if int(match.group(3)) != 0:
                raise CheckpointError(f"{tag!r} holds {name}: a checkpoint with tensor parallelism (mp_rank > 0), "
                                      "which zeroimpl does not shard; only data-parallel ZeRO-1/2 checkpoints convert")
            found[int(match.group(2))] = os.path.join(tag, name)
    if not found:
        raise CheckpointError(f"{tag!r} has no zero_pp_rank_*_mp_rank_00_optim_states.pt: not a ZeRO-1/2 checkpoint")
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(f"{tag!r} has the optimizer files of data-parallel ranks {sorted(found)}: some are "
                              "missing")
    return [found[rank] for rank in range(len(found))]


def _stand_in_class(module: str, name: str) -> type:
    """A class named as DeepSpeed's ``module.name`` that keeps what it is built with (``args``, its state)."""
    def new(cls, *args, **kwargs):
        made = object.__new__(cls)
        made.args = args
        return made
    return type(name, (), {"__module__": module, "__new__": new, "__init__": lambda self, *args, **kwargs: None})


_STAND_INS = [_stand_in_class(module, name) for module, name in (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"), ("deepspeed.utils.tensor_fragment", "fragment_address"))]


def _read(path: str) -> dict:
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - a class we have no stand-in for, a truncated file
        raise CheckpointError(f"{path} cannot be read as a DeepSpeed ZeRO-1/2 file ({type(error).__name__}: "
                              f"{str(error)[:400]})") from error


class SavedParam(NamedTuple):
    """One trainable parameter's optimizer state as DeepSpeed saved it, in the parameter's shape (fp32)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: Union[int, float, torch.Tensor]


def _check_source(common: dict) -> None:
    """Refuse what this conversion does not carry, from the state every rank shares (a rank file's, or the universal
    format's ``optimizer_state.pt``)."""
    if "zero_stage" not in common:
        raise CheckpointError("the checkpoint's optimizer files hold DeepSpeed's BF16_Optimizer state (bf16 without "
                              "ZeRO's own optimizer), which this conversion does not read yet")
    stage = common["zero_stage"]
    stage = stage.args[0] if hasattr(stage, "args") else stage
    if int(stage) not in (1, 2):
        raise CheckpointError(f"the checkpoint is of ZeRO stage {int(stage)}: only stages 1 and 2 convert")
    scaler = common.get("loss_scaler")
    if not getattr(scaler, "dynamic", False) and float(getattr(scaler, "cur_scale", 1.0)) != 1.0:
        raise CheckpointError("the checkpoint was trained with a static fp16 loss scale, which zeroimpl's dynamic "
                              "loss scaler does not keep: convert the weights with DeepSpeed's zero_to_fp32.py")
    if getattr(scaler, "dynamic", False) and getattr(scaler, "consecutive_hysteresis", False):
        raise CheckpointError("the checkpoint's fp16 loss scaler refills its hysteresis after every clean step "
                              "(consecutive_hysteresis), which zeroimpl's loss scaler does not: it cannot continue "
                              "as DeepSpeed would")


def _loss_scale(common: dict, model_states: dict) -> Optional[tuple[LossScaleConfig, dict]]:
    """DeepSpeed's dynamic fp16 loss scaler as zeroimpl's: its settings, and its state at the save (the scale,
    the clean steps counted towards the next growth, the overflows left before it backs off, the steps skipped);
    None without one. Both back off at the overflow that finds one hysteresis left and refill it on growth.
    DeepSpeed grows at a clean step that follows a positive multiple of its window of clean steps since the last
    overflow (``stable``: ``cur_iter - last_overflow_iter - 1`` at the next step), zeroimpl after a window of clean
    steps since it last grew or backed off: the count below makes the next growth fall on DeepSpeed's step (-1
    where the save follows an overflow, or no step: DeepSpeed then waits a window and one more clean step). After
    a later overflow zeroimpl regrows one clean step before DeepSpeed would."""
    scaler = common.get("loss_scaler")
    if not getattr(scaler, "dynamic", False):
        return None
    config = LossScaleConfig(initial_scale=float(scaler.cur_scale), growth_factor=float(scaler.scale_factor),
                             backoff_factor=1.0 / float(scaler.scale_factor),
                             growth_interval=int(scaler.scale_window), hysteresis=int(scaler.delayed_shift),
                             min_scale=float(scaler.min_scale))
    window, stable = int(scaler.scale_window), int(scaler.cur_iter) - int(scaler.last_overflow_iter) - 1
    clean = window - 1 - (-stable) % window if stable > 0 else -1  # DeepSpeed grows 1 + (-stable) % window steps on
    return config, {"scale": float(scaler.cur_scale), "clean_steps": clean,
                    "hysteresis_left": int(scaler.cur_hysteresis),
                    "skipped_steps": int(model_states.get("skipped_steps") or 0)}


def _partitioned_state(model_states: dict, ranks: list[dict]) -> dict[str, SavedParam]:
    """Each trainable parameter's state, by name, from the ranks' flat partitions of every group."""
    by_name = {}
    for g, shapes in enumerate(model_states["param_shapes"]):
        flat = {key: torch.cat([_partition(rank, g, key) for rank in ranks]) for key in ("master", "exp_avg",
                                                                                         "exp_avg_sq")}
        step = ranks[0]["base_optimizer_state"]["state"][g]["step"]
        saved_paddings = ranks[0].get("param_alignment_paddings")  # (a checkpoint without them: no padding)
        paddings = saved_paddings[g] if saved_paddings else [0] * len(shapes)
        offset = 0
        for (name, shape), padding in zip(shapes.items(), paddings):
            numel = torch.Size(shape).numel()
            by_name[name] = SavedParam(*(flat[key][offset:offset + numel].view(shape).clone() for key in flat),
                                       step.clone() if torch.is_tensor(step) else step)
            offset += numel + padding
    return by_name


def _universal_state(tag: str, model_states: dict) -> dict[str, SavedParam]:
    """Each trainable parameter's state, by name, from the universal format's folder per parameter; refusing a
    folder of parameters other than the saved model's (pipeline stages) or of other shapes (tensor parallelism)."""
    folder = os.path.join(tag, UNIVERSAL)
    trainable = {name: torch.Size(shape) for shapes in model_states["param_shapes"] for name, shape in shapes.items()}
    named = set(trainable) | set(model_states["module"]) | set(model_states.get("shared_params") or ())
    # (the module's names cover the frozen parameters, which ZeRO-1 leaves out of frozen_param_shapes)
    present = {entry for entry in os.listdir(folder) if os.path.isdir(os.path.join(folder, entry))}
    if present - named or set(trainable) - present:
        raise CheckpointError(f"{folder!r} holds the parameters {sorted(present - named)[:5]} that {MODEL_STATES} "
                              f"does not name, and misses {sorted(set(trainable) - present)[:5]} that it does: not "
                              "the universal format of one data-parallel ZeRO-1/2 model (pipeline stages, or "
                              "another model's folder)")
    by_name = {}
    for name, shape in trainable.items():
        values = [_universal_tensor(os.path.join(folder, name, key + ".pt"))
                  for key in ("fp32", "exp_avg", "exp_avg_sq")]
        if any(value.shape != shape for value in values):
            raise CheckpointError(f"{name} has the shape {tuple(values[0].shape)} in {folder!r} and {tuple(shape)} "
                                  f"in {MODEL_STATES}: a universal checkpoint merged from tensor-parallel ranks, "
                                  "which zeroimpl does not shard; only data-parallel ZeRO-1/2 checkpoints convert")
        by_name[name] = SavedParam(*values, _read(os.path.join(folder, name, "step.pt")))
    return by_name


def _universal_tensor(path: str) -> torch.Tensor:
    saved = _read(path)
    return (saved["param"] if isinstance(saved, dict) else saved).float()


def _converted(model_states: dict, saved_groups: list[dict],
               by_name: dict[str, SavedParam]) -> tuple[list[dict], torch.nn.Module, dict, type]:
    """(param groups over a stand-in model, the stand-in, a torch optimizer state dict over those groups, the torch
    optimizer class), from the saved torch param groups (hyperparameters) and each parameter's state."""
    if not isinstance(saved_groups, list) or len(saved_groups) != len(model_states["param_shapes"]):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups or ())} param groups and "
                              f"{MODEL_STATES} {len(model_states['param_shapes'])}: the files are not of one save")
    stand_in, params = _stand_in_model(model_states["module"], model_states)
    optimizer_class = _optimizer_class(model_states, saved_groups)
    groups, state, number = [], {}, 0
    for saved_group, shapes in zip(saved_groups, model_states["param_shapes"]):
        members = []
        for name in shapes:
            saved = by_name[name]
            with torch.no_grad():
                params[name].copy_(saved.master)
            state[number] = {"step": saved.step, "exp_avg": saved.exp_avg, "exp_avg_sq": saved.exp_avg_sq}
            members.append(params[name])
            number += 1
        groups.append({"params": members, **_torch_hyperparameters(saved_group, optimizer_class)})
    firsts = [0]  # torch numbers the parameters over the groups in order
    for group in groups:
        firsts.append(firsts[-1] + len(group["params"]))
    torch_state = {"state": state, "param_groups": [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(first, end))}
        for group, first, end in zip(groups, firsts, firsts[1:])]}
    return groups, stand_in, torch_state, optimizer_class


def _partition(rank: dict, group: int, key: str) -> torch.Tensor:
    """A rank's range of a group's flat fp32 master (``key`` "master") or Adam state, without padding."""
    master = rank["single_partition_of_fp32_groups"][group]
    if key == "master":
        return master.float()
    state = rank["base_optimizer_state"]["state"][group]
    unknown = set(state) - _ADAM_KEYS
    if unknown:
        raise CheckpointError(f"the checkpoint's optimizer state has {sorted(unknown)}: only Adam and AdamW "
                              "(exp_avg, exp_avg_sq, step) convert")
    return state[key][:master.numel()].float()


def _stand_in_model(module: dict, model_states: dict) -> tuple[torch.nn.Module, dict]:
    """A module tree with the saved names, in the saved order: the trainable parameters (fp32), the frozen ones and
    the buffers as saved, tied names sharing one parameter. Returns it and its trainable parameters by name."""
    trainable = {name for shapes in model_states["param_shapes"] for name in shapes}
    frozen = set(model_states.get("frozen_param_shapes") or ())
    buffers = set(model_states.get("buffer_names") or ())
    shared = dict(model_states.get("shared_params") or {})
    root, made = torch.nn.Module(), {}
    for name, tensor in module.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        if name in shared:
            if shared[name] not in made:
                raise CheckpointError(f"the checkpoint ties {name} to {shared[name]}, which it does not hold before it")
            owner.register_parameter(leaf, made[shared[name]])
        elif name in trainable:
            made[name] = torch.nn.Parameter(torch.empty(tensor.shape, dtype=torch.float32))
            owner.register_parameter(leaf, made[name])
        elif name in frozen:
            made[name] = torch.nn.Parameter(tensor.clone(), requires_grad=False)
            owner.register_parameter(leaf, made[name])
        elif name in buffers:
            owner.register_buffer(leaf, tensor.clone())
        else:
            owner.register_buffer(leaf, tensor.clone(), persistent=True)
    return root, made


def _optimizer_class(model_states: dict, groups: list[dict]) -> type:
    """torch's AdamW or Adam, as the DeepSpeed config says (``type``; ``adam_w_mode`` for "Adam", which defaults to
    AdamW) or, without one (a client optimizer), as torch's own param groups say (``decoupled_weight_decay``); a
    checkpoint that tells neither is refused. DeepSpeed's own kernels (FusedAdam, DeepSpeedCPUAdam with
    ``offload_optimizer``) become torch's class of the same update rule."""
    config = model_states.get("ds_config")
    config = config if isinstance(config, dict) else {}  # (a JSON path, or None, where the job passed no dict)
    named = (config.get("optimizer") or {}).get("type")
    if named is not None:
        kind = str(named).lower()
        if kind == "adamw":
            return torch.optim.AdamW
        if kind == "adam":
            adam_w_mode = (config["optimizer"].get("params") or {}).get("adam_w_mode", True)
            return torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        raise CheckpointError(f"the checkpoint's optimizer is DeepSpeed's {named!r}: only Adam and AdamW convert")
    decoupled = {group.get("decoupled_weight_decay") for group in groups}
    if decoupled == {True}:
        return torch.optim.AdamW
    if decoupled == {False}:
        return torch.optim.Adam
    raise CheckpointError("the checkpoint says neither in its DeepSpeed config nor in its param groups whether its "
                          "Adam decays weights as AdamW or as Adam (L2): it cannot be converted safely")


def _torch_hyperparameters(group: dict, optimizer_class: type) -> dict:
    """A saved param group's hyperparameters that ``optimizer_class`` has (a DeepSpeed kernel's own, such as
    ``bias_correction``, dropped once checked to be what torch does)."""
    if group.get("bias_correction", True) is not True:
        raise CheckpointError("the checkpoint's Adam ran without bias correction, which torch's Adam has no setting "
                              "for: it cannot be converted")
    known = set(optimizer_class([torch.nn.Parameter(torch.zeros(1))]).defaults) | {"initial_lr"}
    return {key: value for key, value in group.items() if key in known}
