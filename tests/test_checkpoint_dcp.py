"""torch.distributed.checkpoint (DCP) both ways (issue 56 point 1): ``zeroimpl.checkpoint.DCPState`` against DDP and
FSDP2 (``fully_shard`` per block, then the model) with torch's AdamW.

2 CPU ranks (gloo), fp32, the tiny GPT-2 of tests/workloads.py (two param groups, a frozen parameter, tied
embeddings), AdamW, 4 steps on slices of fixed global batches clipped at 1.0, a DCP checkpoint, 4 more steps. A job
that switches is compared with the job that did not:

* DCPState's state dict, over both ranks, has the keys, full shapes and dtypes of ``get_state_dict(model, AdamW,
  StateDictOptions(flatten_optimizer_state_dict=True))``;
* FSDP2 -> zeroimpl stage 2, and zeroimpl stage 2 -> FSDP2, at 2 ranks: bitwise the job that did not switch;
* DDP -> zeroimpl stage 1 at 2 ranks: bitwise DDP's job; stage 2 with CPU offload at 3 ranks and on a 2 x 2 mesh:
  within PARAM_ATOL = 1e-4 of it (the parity tolerance: another reduction order, which Adam turns into up to lr on
  near-zero gradients); the mesh's own save loads exactly at 3 ranks;
* zeroimpl (2 ranks, stage 2) -> one process, plain AdamW through ``set_state_dict``: the parameters and the
  optimizer state loaded are bitwise zeroimpl's at the save (its consolidated state dict); the 4 steps after, on
  the whole global batch in one process, within PARAM_ATOL (the summation order changes);
* at AdamW's default lr (DEFAULT_LR), DDP -> zeroimpl at 3 ranks and zeroimpl -> one process: within
  ACROSS_SIZES_ATOL = 1e-6 of the job that did not switch (at LR the world size's summation order alone moves DDP
  itself by 5.6e-5);
* ``dcp.async_save``: a step taken before its future is waited for does not change what is written;
* a checkpoint of another model, of another optimizer class, or without the optimizer's state is refused on every
  rank by DCP's planner, naming the key, before anything is read;
* what DCP's format cannot carry is refused by name when the DCPState is built: fp16 loss scaling,
  ``quantize_param_gather``, a parameter in another memory format.
"""

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from distributed import run_distributed
from workloads import build_model, local_batch, max_param_diff, param_groups, train_on_global_batch
from zeroimpl import ShardedOptimizer
from zeroimpl.checkpoint import CheckpointError, DCPState

SAVE_AT, STEPS, LR = 4, 8, 1e-2
PARAM_ATOL = 1e-4
# AdamW's own default learning rate, where a switch across world sizes stays within the bound: the summation
# order changes with the world size, and how far Adam carries that grows faster than the lr (at LR, DDP itself at 3
# ranks ends 5.6e-5 from DDP at 2; at DEFAULT_LR, 5.7e-7)
DEFAULT_LR, ACROSS_SIZES_ATOL = 1e-3, 1e-6
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _zero(stage=2, model_dtype=torch.float32, transposed=False, lr=LR, **options):
    model = build_model("gpt2", model_dtype)
    if transposed:  # a parameter in another memory format: its storage holds the transpose
        model.transformer.h[0].mlp.c_fc.weight.data = model.transformer.h[0].mlp.c_fc.weight.data.t().contiguous().t()
    return model, ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, bucket_numel=4096, lr=lr,
                                   **options)


def _fsdp():
    from torch.distributed.fsdp import fully_shard

    model = build_model("gpt2", torch.float32)
    for block in model.transformer.h:
        fully_shard(block)
    return fully_shard(model)


def _train(model, optimizer, rank, world_size, steps):
    """Torch's own loop (DDP, FSDP2 or one process): forward, backward, clip at 1.0, step."""
    for step in steps:
        model(**local_batch(step, rank, world_size)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


def _params(model):
    """By the bare model's names (DDP's ``module.`` dropped), FSDP2's DTensors gathered."""
    model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def _described(state: dict) -> dict:
    return {key: (tuple(value.shape), value.dtype) if torch.is_tensor(value) else value for key, value in state.items()}


def _save_torch(model, optimizer, path, future=False):
    model_state, optimizer_state = get_state_dict(model, optimizer, options=FLAT)
    return (dcp.async_save if future else dcp.save)({"app": {"model": model_state, "optim": optimizer_state}},
                                                    checkpoint_id=path)


def _load_torch(model, optimizer, path):
    model_state, optimizer_state = get_state_dict(model, optimizer, options=FLAT)
    loaded = {"app": {"model": model_state, "optim": optimizer_state}}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=loaded["app"]["model"],
                   optim_state_dict=loaded["app"]["optim"], options=FLAT)


class _Tempered(torch.nn.Module):
    """A linear map and a 0-dim parameter (a learnable temperature, as CLIP's ``logit_scale``) that the loss uses
    from step 1 on: until then it has no gradient, and no optimizer state, in torch's optimizers and in zeroimpl."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 4)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, step, rank, world_size):
        rows = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        out = self.body(rows[rank * 8 // world_size:(rank + 1) * 8 // world_size])
        return (out * self.temperature if step >= 1 else out).square().mean()


class _PositiveLr(torch.optim.SGD):
    """SGD that refuses a learning rate of 0, as some optimizers' checks do."""

    def __init__(self, params, lr=1e-3, **options):
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        super().__init__(params, lr=lr, **options)


def _train_tempered(model, optimizer, rank, world_size, steps):
    for step in steps:
        model(step, rank, world_size).backward()
        optimizer.step()
        optimizer.zero_grad()


def _tempered_zero(stage=2, **options):
    model = _Tempered()
    return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=LR, **options)


def _tempered(rank, world_size, root, out):
    """The 0-dim parameter and the parameter without state, saved by zeroimpl after step 0 and 2 and by DDP after
    step 2; the key names of a compiled DDP model."""
    model, optimizer = _tempered_zero()
    _train_tempered(model, optimizer, rank, world_size, range(1))
    out["tempered keys"] = _described(DCPState(model, optimizer).state_dict()["optim"])
    dcp.save({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "tempered-0"))
    _train_tempered(model, optimizer, rank, world_size, range(1, 3))
    out["tempered at 2"] = _params(model)
    dcp.save({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "tempered-2"))
    _train_tempered(model, optimizer, rank, world_size, range(3, 5))
    out["tempered"] = _params(model)

    ddp = torch.nn.parallel.DistributedDataParallel(_Tempered(), find_unused_parameters=True)
    adamw = torch.optim.AdamW(ddp.parameters(), lr=LR)
    _train_tempered(ddp, adamw, rank, world_size, range(1))
    out["torch tempered keys"] = _described(get_state_dict(ddp, adamw, options=FLAT)[1])
    _train_tempered(ddp, adamw, rank, world_size, range(1, 3))
    _save_torch(ddp, adamw, os.path.join(root, "tempered-ddp"))
    _train_tempered(ddp, adamw, rank, world_size, range(3, 5))
    out["tempered ddp"] = _params(ddp)

    compiled = torch.compile(torch.nn.parallel.DistributedDataParallel(_Tempered()))
    out["compiled ddp names"] = sorted(DCPState(compiled, ShardedOptimizer(
        compiled.parameters(), torch.optim.AdamW, stage=1, lr=LR)).state_dict()["model"])


def _save_all(rank, world_size, root):
    out = {}
    _tempered(rank, world_size, root, out)
    model, optimizer = _zero()
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT))
    state = DCPState(model, optimizer).state_dict()
    out["keys"] = {part: _described(state[part]) for part in ("model", "optim")}
    optimizer.consolidate_state_dict(to=0)
    out["consolidated"] = copy.deepcopy(optimizer.state_dict()) if rank == 0 else None  # (live tensors otherwise)
    out["at_save"] = _params(model)
    dcp.save({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "zeroimpl"))
    # (a process group of its own, as torchtitan gives it: the save's last collective runs on a thread of its own,
    # beside the training's collectives)
    written = dcp.async_save({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "async"),
                             process_group=torch.distributed.new_group(backend="gloo"))
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, SAVE_AT + 1))  # before the wait
    written.result()
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT + 1, STEPS))
    out["zeroimpl"] = _params(model)

    plain = build_model("gpt2", torch.float32)
    out["torch keys"] = {part: _described(state) for part, state in
                         zip(("model", "optim"), get_state_dict(plain, torch.optim.AdamW(param_groups(plain), lr=LR),
                                                                options=FLAT))}

    for name, build in (("ddp", lambda m: torch.nn.parallel.DistributedDataParallel(m)), ("fsdp", None)):
        model = _fsdp() if build is None else build(build_model("gpt2", torch.float32))
        optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
        _train(model, optimizer, rank, world_size, range(SAVE_AT))
        _save_torch(model, optimizer, os.path.join(root, name))
        _train(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
        out[name] = _params(model)

    model = torch.nn.parallel.DistributedDataParallel(build_model("gpt2", torch.float32))
    sgd = torch.optim.SGD(param_groups(model), lr=LR, momentum=0.9)
    _train(model, sgd, rank, world_size, range(1))
    _save_torch(model, sgd, os.path.join(root, "sgd"))
    dcp.save({"app": {"model": get_state_dict(model, sgd, options=FLAT)[0]}},
             checkpoint_id=os.path.join(root, "model-only"))
    return out


def _one_process(rank, world_size, root):
    out = {}
    for name in ("zeroimpl", "async"):
        model = build_model("gpt2", torch.float32)
        optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
        _load_torch(model, optimizer, os.path.join(root, name))
        out[name] = {"params": _params(model), "state": copy.deepcopy(optimizer.state_dict())}
        _train(model, optimizer, 0, 1, range(SAVE_AT, STEPS))
        out[name]["final"] = _params(model)
    model = _Tempered()
    _load_torch(model, torch.optim.AdamW(model.parameters(), lr=LR), os.path.join(root, "tempered-2"))
    out["tempered"] = _params(model)
    return out


def _switch_at_2(rank, world_size, root):
    out = {}
    for name, stage in (("fsdp", 2), ("ddp", 1)):
        model, optimizer = _zero(stage)
        dcp.load({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, name))
        train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
        out[name] = _params(model)
    model = _fsdp()
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
    _load_torch(model, optimizer, os.path.join(root, "zeroimpl"))
    _train(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
    out["zeroimpl on fsdp"] = _params(model)

    out["refused"] = {}
    for what, checkpoint, build in (("another model", "zeroimpl", lambda: build_model("llama", torch.float32)),
                                    ("another optimizer class", "sgd", None),
                                    ("no optimizer state", "model-only", None)):
        model = build() if build else build_model("gpt2", torch.float32)
        optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096, lr=LR)
        before = _params(model)
        try:
            dcp.load({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, checkpoint))
            out["refused"][what] = None
        except CheckpointException as error:  # (DCP's, a BaseException: raised on every rank)
            out["refused"][what] = str(error)
        out["refused"][what + " unchanged"] = all(torch.equal(p, before[n]) for n, p in _params(model).items())
    model, optimizer = _tempered_zero()
    dcp.load({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "tempered-2"))
    _train_tempered(model, optimizer, rank, world_size, range(3, 5))
    out["tempered from 2"] = _params(model)
    model, optimizer = _tempered_zero()  # nothing stepped: placeholders for every parameter, the temperature's too
    try:
        dcp.load({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "tempered-0"))
        out["tempered from 0"] = None
    except CheckpointException as error:
        out["tempered from 0"] = str(error)
    model, optimizer = _tempered_zero(stage=1)
    dcp.load({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "tempered-ddp"))
    _train_tempered(model, optimizer, rank, world_size, range(3, 5))
    out["tempered from ddp"] = _params(model)
    model = _Tempered()  # the temperature in a group of its own, whose class refuses lr=0: on one rank only
    optimizer = ShardedOptimizer([{"params": [model.body.weight, model.body.bias]},
                                  {"params": [model.temperature], "optimizer": _PositiveLr}],
                                 torch.optim.AdamW, stage=2, lr=LR, assume_elementwise=True)
    try:
        dcp.save({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "never"))
        out["no placeholder"] = None
    except CheckpointError as error:
        out["no placeholder"] = str(error)

    out["refused at construction"] = {}
    for what, build in (("fp16", lambda: _zero(model_dtype=torch.float16)),
                        ("quantize_param_gather", lambda: _zero(quantize_param_gather=True)),
                        ("not contiguous", lambda: _zero(transposed=True))):
        model, optimizer = build()
        try:
            DCPState(model, optimizer)
            out["refused at construction"][what] = None
        except CheckpointError as error:
            out["refused at construction"][what] = str(error)
    return out


def _on_a_mesh(rank, world_size, root):
    """DDP's checkpoint onto a 2 x 2 mesh (replicate x shard), 4 steps, then saved from the mesh (each shard once)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, optimizer = _zero(2, device_mesh=mesh)
    dcp.load({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "ddp"))
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
    dcp.save({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "mesh"))
    return _params(model)


def _switch_at_3(rank, world_size, root):
    out = {}
    model, optimizer = _zero(2, offload="cpu")
    dcp.load({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "ddp"))
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
    out["ddp"] = _params(model)
    model, optimizer = _zero(1)
    dcp.load({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "mesh"))
    out["mesh"] = _params(model)
    return out


def _default_lr_saved(rank, world_size, root):
    """At DEFAULT_LR, the jobs that do not switch: DDP + AdamW and zeroimpl stage 2, 4 steps, a DCP checkpoint
    each, 4 more."""
    model = torch.nn.parallel.DistributedDataParallel(build_model("gpt2", torch.float32))
    adamw = torch.optim.AdamW(param_groups(model), lr=DEFAULT_LR)
    _train(model, adamw, rank, world_size, range(SAVE_AT))
    _save_torch(model, adamw, os.path.join(root, "ddp-default-lr"))
    _train(model, adamw, rank, world_size, range(SAVE_AT, STEPS))
    out = {"ddp": _params(model)}
    model, optimizer = _zero(lr=DEFAULT_LR)
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT))
    dcp.save({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "zeroimpl-default-lr"))
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
    out["zeroimpl"] = _params(model)
    return out


def _default_lr_switched(rank, world_size, root):
    """At DEFAULT_LR: DDP's checkpoint continued on zeroimpl (at 3 ranks), or zeroimpl's on AdamW (one process)."""
    if world_size == 1:
        model = build_model("gpt2", torch.float32)
        optimizer = torch.optim.AdamW(param_groups(model), lr=DEFAULT_LR)
        _load_torch(model, optimizer, os.path.join(root, "zeroimpl-default-lr"))
        _train(model, optimizer, 0, 1, range(SAVE_AT, STEPS))
        return _params(model)
    model, optimizer = _zero(2, lr=DEFAULT_LR)
    dcp.load({"app": DCPState(model, optimizer)}, checkpoint_id=os.path.join(root, "ddp-default-lr"))
    train_on_global_batch(model, optimizer, rank, world_size, range(SAVE_AT, STEPS))
    return _params(model)


@pytest.fixture(scope="module")
def default_lr_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp-default-lr"))
    return {"saved": run_distributed(2, _default_lr_saved, root),
            "at 3": run_distributed(3, _default_lr_switched, root),
            "one process": run_distributed(1, _default_lr_switched, root)[0]}


def test_across_world_sizes_a_switch_at_adamws_default_lr_is_within_1e_6_of_the_job_that_did_not_switch(
        default_lr_runs):
    """DDP (2 ranks) -> zeroimpl at 3 ranks (measured 5.0e-7), and zeroimpl (2 ranks) -> torch's AdamW in one process
    (5.4e-7), at DEFAULT_LR."""
    saved = default_lr_runs["saved"][0]
    far = max(max_param_diff(params, saved["ddp"]) for params in default_lr_runs["at 3"])
    assert far <= ACROSS_SIZES_ATOL, far
    far = max_param_diff(default_lr_runs["one process"], saved["zeroimpl"])
    assert far <= ACROSS_SIZES_ATOL, far


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    saved = run_distributed(2, _save_all, root)
    return {"saved": saved, "one process": run_distributed(1, _one_process, root)[0],
            "at 2": run_distributed(2, _switch_at_2, root), "on a mesh": run_distributed(4, _on_a_mesh, root),
            "at 3": run_distributed(3, _switch_at_3, root)}


def test_dcp_state_has_the_keys_shapes_and_dtypes_of_torchs_get_state_dict(runs):
    saved = runs["saved"]
    for part in ("model", "optim"):
        union = {key: value for by_rank in saved for key, value in by_rank["keys"][part].items()}
        assert union == saved[0]["torch keys"][part]
    assert all(by_rank["keys"]["model"] == saved[0]["torch keys"]["model"] for by_rank in saved)


def test_fsdp2_and_zeroimpl_continue_each_others_checkpoints_bitwise(runs):
    saved, at_2 = runs["saved"], runs["at 2"]
    for rank in range(2):
        assert max_param_diff(at_2[rank]["fsdp"], saved[rank]["fsdp"]) == 0.0
        assert max_param_diff(at_2[rank]["zeroimpl on fsdp"], saved[rank]["zeroimpl"]) == 0.0


def test_a_ddp_checkpoint_continues_on_zeroimpl_at_2_and_3_ranks(runs):
    saved = runs["saved"]
    for rank in range(2):  # (at 2 ranks the sums are DDP's: bitwise)
        assert max_param_diff(runs["at 2"][rank]["ddp"], saved[rank]["ddp"]) == 0.0
    for by_rank in runs["at 3"]:
        assert max_param_diff(by_rank["ddp"], saved[0]["ddp"]) <= PARAM_ATOL


def test_a_mesh_loads_and_saves_through_dcp(runs):
    """DDP's checkpoint continues on a 2 x 2 mesh (4 ranks: within the parity tolerance of DDP at 2), and what the
    mesh saves (its replicas write the same boxes, which DCP writes once) loads exactly at 3 ranks, stage 1."""
    on_mesh = runs["on a mesh"]
    for params in on_mesh:
        assert max_param_diff(params, runs["saved"][0]["ddp"]) <= PARAM_ATOL
    for by_rank in runs["at 3"]:
        assert max_param_diff(by_rank["mesh"], on_mesh[0]) == 0.0


def test_a_zeroimpl_checkpoint_continues_in_one_process_with_torchs_adamw(runs):
    """Loaded exactly (parameters and state bitwise zeroimpl's consolidated state at the save), then 4 steps."""
    saved, alone = runs["saved"], runs["one process"]["zeroimpl"]
    assert max_param_diff(alone["params"], saved[0]["at_save"]) == 0.0
    consolidated = saved[0]["consolidated"]
    assert consolidated["state"].keys() == alone["state"]["state"].keys()
    for number, state in consolidated["state"].items():
        for key, value in state.items():
            assert torch.equal(alone["state"]["state"][number][key], value), (number, key)
    assert max_param_diff(alone["final"], saved[0]["zeroimpl"]) <= PARAM_ATOL


def test_an_async_save_writes_the_state_of_its_call_while_training_goes_on(runs):
    saved, alone = runs["saved"], runs["one process"]
    assert max_param_diff(alone["async"]["params"], saved[0]["at_save"]) == 0.0
    for number, state in saved[0]["consolidated"]["state"].items():
        for key, value in state.items():
            assert torch.equal(alone["async"]["state"]["state"][number][key], value), (number, key)


@pytest.mark.parametrize("what, key", [("another model", "app.model.model.embed_tokens.weight"),
                                       ("another optimizer class", "app.optim.state.transformer."),
                                       ("no optimizer state", "app.optim.state.")])
def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank_naming_the_key(runs, what, key):
    for by_rank in runs["at 2"]:
        refused = by_rank["refused"][what]
        assert refused is not None and "Missing key in checkpoint state_dict" in refused and key in refused, refused
        assert by_rank["refused"][what + " unchanged"]


@pytest.mark.parametrize("what, named", [("fp16", "loss scale"), ("quantize_param_gather", "quantize_param_gather"),
                                         ("not contiguous", "not contiguous")])
def test_what_dcps_format_cannot_carry_is_refused_by_name(runs, what, named):
    for by_rank in runs["at 2"]:
        refused = by_rank["refused at construction"][what]
        assert refused is not None and named in refused and "save_checkpoint" in refused, refused


@pytest.mark.parametrize("seed", range(20))
def test_the_boxes_of_a_flat_range_cover_it_in_order_each_contiguous(seed):
    """In process, random shapes and ranges: the boxes' elements, in order, are exactly the range's, and each box
    is one contiguous run of the row-major tensor."""
    from zeroimpl.checkpoint.dcp import boxes

    generator = torch.Generator().manual_seed(seed)
    shape = tuple(int(n) for n in torch.randint(1, 6, (int(torch.randint(1, 5, (1,), generator=generator)),),
                                                generator=generator))
    numel = torch.Size(shape).numel()
    start, end = sorted(int(n) for n in torch.randint(0, numel + 1, (2,), generator=generator))
    numbers = torch.arange(numel).view(shape)
    covered = []
    for offsets, sizes in boxes(shape, start, end):
        region = numbers[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
        assert torch.equal(region, torch.arange(int(region[0]), int(region[0]) + region.numel()))  # contiguous
        covered += region.tolist()
    assert covered == list(range(start, end))


def test_a_0_dim_parameter_and_one_without_state_move_as_in_torch(runs):
    """A 0-dim parameter (the box of no dimensions) goes from zeroimpl to one process of torch, from DDP to zeroimpl
    and from zeroimpl to zeroimpl, bitwise. Saved after step 0, when it had no gradient yet, it has no state entries,
    as in torch's; an optimizer that has not stepped expects state for every parameter (as get_state_dict makes a
    torch optimizer's), so that checkpoint is refused on every rank naming the key, as torch's AdamW refuses it."""
    saved, at_2 = runs["saved"], runs["at 2"]
    keys = {key: value for by_rank in saved for key, value in by_rank["tempered keys"].items()}
    assert keys == saved[0]["torch tempered keys"] and not any("temperature" in key for key in keys if "state." in key)
    assert max_param_diff(runs["one process"]["tempered"], saved[0]["tempered at 2"]) == 0.0
    for rank in range(2):
        assert max_param_diff(at_2[rank]["tempered from 2"], saved[rank]["tempered"]) == 0.0
        assert max_param_diff(at_2[rank]["tempered from ddp"], saved[rank]["tempered ddp"]) == 0.0
        assert "Missing key in checkpoint state_dict: app.optim.state.temperature." in at_2[rank]["tempered from 0"]


def test_a_compiled_ddp_model_is_named_as_the_model(runs):
    for by_rank in runs["saved"]:
        assert by_rank["compiled ddp names"] == ["body.bias", "body.weight", "temperature"]


def test_placeholder_state_that_cannot_be_made_is_refused_on_every_rank(runs):
    """Nothing stepped, and one group's class refuses lr=0: the rank that holds its one element and the rank that
    holds none both raise, where the second would wait in DCP's collective."""
    for by_rank in runs["at 2"]:
        assert by_rank["no placeholder"] is not None and "_PositiveLr" in by_rank["no placeholder"]


def _loaded_state_left_behind(rank, world_size, root):
    """A DCP load into a fresh optimizer, its DCPState kept (as torchtitan keeps its app state), then one step: how
    many of the loaded state tensors are still alive outside the optimizer's state."""
    import gc
    import weakref

    def trained(steps):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 10), torch.nn.Linear(10, 5))
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
        for step in steps:
            model(torch.randn(4, 20, generator=torch.Generator().manual_seed(step))).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer
    dcp.save({"app": DCPState(*trained(range(2)))}, checkpoint_id=os.path.join(root, "left-behind"))
    model, optimizer = trained([])
    app = {"app": DCPState(model, optimizer)}  # kept to the end
    dcp.load(app, checkpoint_id=os.path.join(root, "left-behind"))
    loaded = [weakref.ref(v) for s in optimizer.inner.state.values() for v in s.values() if torch.is_tensor(v)
              and v.dim()]
    model(torch.randn(4, 20)).square().sum().backward()
    optimizer.step()  # its runs join the loaded pieces' state into one tensor each (a copy: separate tensors)
    gc.collect()
    held = {id(v) for s in optimizer.inner.state.values() for v in s.values() if torch.is_tensor(v)}
    return sum(ref() is not None and id(ref()) not in held for ref in loaded), len(loaded)


def test_a_dcp_state_kept_after_its_load_does_not_hold_the_loaded_optimizer_state(tmp_path):
    """The second review of the runs: a DCPState kept its per-piece placeholders after loading, so once a run joined
    them (a copy) the loaded state was held twice, for as long as the app state lived (8 of 8 tensors before)."""
    left, loaded = run_distributed(1, _loaded_state_left_behind, str(tmp_path))[0]
    assert loaded > 0 and left == 0, (left, loaded)
