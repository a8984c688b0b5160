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
followed by its alignment padding (DeepSpeed's own ``zero_to_fp32.py`` reads them so). The files pickle three
DeepSpeed classes (the loss scaler, the stage enum, a fragment address): they are read with
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

import torch
import torch.distributed as dist

from ..optimizer import ShardedOptimizer
from ..state_format import CheckpointError
from .api import save_checkpoint
from .convert import load_torch_optimizer_state

MODEL_STATES = "mp_rank_00_model_states.pt"
_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ADAM_KEYS = {"exp_avg", "exp_avg_sq", "step"}


def from_deepspeed(ds_dir: str, out_dir: str) -> None:
    """Convert the DeepSpeed ZeRO-1/2 checkpoint in ``ds_dir`` (a tag folder, or its parent with ``latest``) into a
    zeroimpl checkpoint at ``out_dir``, which :func:`load_checkpoint` loads at any world size. Carries the fp32
    masters, Adam's moments and step counts, the param groups with their hyperparameters, and the frozen
    parameters and buffers. In one process with no process group of its own (``python -m zeroimpl.checkpoint
    from-deepspeed DS_DIR OUT_DIR``). Adam or AdamW as the saved DeepSpeed config says (or torch's own groups).
    Refused by name: tensor or pipeline parallelism, stage 3, an optimizer other than Adam or AdamW, an Adam that
    tells neither, and, not carried yet, fp16 loss scaling, ``offload_optimizer``, ``elastic_checkpoint`` and
    BF16_Optimizer's state."""
    if dist.is_available() and dist.is_initialized():
        raise CheckpointError("from_deepspeed converts in one process, with a process group of its own: run it "
                              "outside the training job (python -m zeroimpl.checkpoint from-deepspeed DS_DIR OUT_DIR)")
    tag = _tag_folder(ds_dir)
    model_states = _read(os.path.join(tag, MODEL_STATES))
    partitions = _rank_files(tag)
    groups, stand_in, state, optimizer_class = _converted(model_states,
                                                         [_read(path)["optimizer_state_dict"] for path in partitions])
    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(rendezvous, 'store')}", rank=0,
                                world_size=1)
        try:
            optimizer = ShardedOptimizer(groups, optimizer_class, stage=2)
            load_torch_optimizer_state(optimizer, state)
            save_checkpoint(out_dir, optimizer, stand_in)
        finally:
            dist.destroy_process_group()


def _tag_folder(ds_dir: str) -> str:
    if os.path.isfile(os.path.join(ds_dir, MODEL_STATES)):
        return ds_dir
    latest = os.path.join(ds_dir, "latest")
    if os.path.isfile(latest):
        with open(latest) as handle:
            tag = os.path.join(ds_dir, handle.read().strip())
        if os.path.isfile(os.path.join(tag, MODEL_STATES)):
            return tag
        raise CheckpointError(f"{latest} names the tag {os.path.basename(tag)!r}, which has no {MODEL_STATES}")
    if glob.glob(os.path.join(ds_dir, "layer_*-model_states.pt")):
        raise CheckpointError(f"{ds_dir!r} is a DeepSpeed pipeline-parallel checkpoint (layer_*-model_states.pt): "
                              "only data-parallel ZeRO-1/2 checkpoints convert")
    raise CheckpointError(f"{ds_dir!r} is not a DeepSpeed checkpoint: no {MODEL_STATES} in it, and no 'latest' file "
                          "naming a tag folder that has one")


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


def _converted(model_states: dict, ranks: list[dict]) -> tuple[list[dict], torch.nn.Module, dict, type]:
    """(param groups over a stand-in model, the stand-in, a torch optimizer state dict over those groups, the torch
    optimizer class)."""
    first = ranks[0]
    if "zero_stage" not in first:
        raise CheckpointError("the checkpoint's optimizer files hold DeepSpeed's BF16_Optimizer state (bf16 without "
                              "ZeRO's own optimizer), which this conversion does not read yet")
    stage = first["zero_stage"]
    stage = stage.args[0] if hasattr(stage, "args") else stage
    if int(stage) not in (1, 2):
        raise CheckpointError(f"the checkpoint is of ZeRO stage {int(stage)}: only stages 1 and 2 convert")
    scaler = first.get("loss_scaler")
    if getattr(scaler, "dynamic", False) or float(getattr(scaler, "cur_scale", 1.0)) != 1.0:
        raise CheckpointError("the checkpoint was trained with fp16 loss scaling, which this conversion does not "
                              "carry yet: train in bf16 or fp32, or convert the weights with DeepSpeed's "
                              "zero_to_fp32.py")
    if not isinstance(first.get("base_optimizer_state"), dict):
        raise CheckpointError("the checkpoint was saved with elastic_checkpoint (its optimizer state is per group, "
                              "without param groups), which this conversion does not read yet")
    module = model_states["module"]
    stand_in, params = _stand_in_model(module, model_states)
    optimizer_class = _optimizer_class(model_states, first["base_optimizer_state"]["param_groups"])
    base_groups = [_torch_hyperparameters(group, optimizer_class)
                   for group in first["base_optimizer_state"]["param_groups"]]
    groups, state, number = [], {}, 0
    for g, shapes in enumerate(model_states["param_shapes"]):
        flat = {key: torch.cat([_partition(rank, g, key) for rank in ranks]) for key in ("master", "exp_avg",
                                                                                         "exp_avg_sq")}
        step = first["base_optimizer_state"]["state"][g]["step"]
        saved_paddings = first.get("param_alignment_paddings")  # (a checkpoint without them: no padding)
        paddings = saved_paddings[g] if saved_paddings else [0] * len(shapes)
        members, offset = [], 0
        for (name, shape), padding in zip(shapes.items(), paddings):
            numel = torch.Size(shape).numel()
            with torch.no_grad():
                params[name].copy_(flat["master"][offset:offset + numel].view(shape))
            state[number] = {"step": step.clone() if torch.is_tensor(step) else step,
                             **{key: flat[key][offset:offset + numel].view(shape).clone()
                                for key in ("exp_avg", "exp_avg_sq")}}
            members.append(params[name])
            offset += numel + padding
            number += 1
        groups.append({"params": members, **base_groups[g]})
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
    AdamW) or, without one (a client optimizer), as torch's own param groups say (``decoupled_weight_decay``).
    DeepSpeed's CPU Adam (``offload_optimizer``) is refused, as is a checkpoint that tells neither."""
    config = model_states.get("ds_config")
    config = config if isinstance(config, dict) else {}  # (a JSON path, or None, where the job passed no dict)
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if str(offload.get("device", "none")).lower() != "none":
        raise CheckpointError("the checkpoint was trained with offload_optimizer (DeepSpeedCPUAdam), whose state this "
                              "conversion does not carry yet: convert the weights with DeepSpeed's zero_to_fp32.py")
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
