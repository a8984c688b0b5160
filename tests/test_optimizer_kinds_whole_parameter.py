"""Whole-parameter shards (Muon, Adafactor, classes marked per-parameter) and several optimizer classes in one
ShardedOptimizer, against DDP + the same torch optimizers.

The hidden matrices step with Muon or Adafactor, embeddings, norms and biases with AdamW (decay / no decay),
as Muon recipes train; tiny GPT-2 and LLaMA with a frozen parameter and small buckets (several whole buckets).
Every run clips by the inf-norm across all groups. Bitwise at world size 2 (a whole parameter's reduced
gradient is the same two-term sum as DDP's; offload with the same, unfused kernel). At world sizes 3 and 4,
and in stage 2 with accumulation, the reduction sums in another order:
* WHOLE_ATOL = 1e-4 on parameters without Muon (Adafactor + AdamW), the core parity tolerance (Adam turns
  last-bit gradient differences into up to about lr on near-zero entries); losses within LOSS_ATOL = 1e-3.
* MUON_RTOL = 0.25 with Muon, on every parameter, in relative L2 of its change from the initial weights.
  torch's Muon orthogonalises in bfloat16, which turns last-bit gradient differences into bf16 roundings
  (and, through the forward pass, into different gradients of every other parameter): plain torch Muon +
  AdamW on the global batch, with every gradient scaled by (1 + 2**-22), moves tiny GPT-2's parameters
  2.3% and LLaMA's 6.9% (relative L2) away from the unperturbed run in 5 steps (measured); a wrong owner or
  a lost update moves them by 100%.
"""

import os

import pytest
import torch

from distributed import run_distributed
from workloads import (NormalizedSGD, RunConfig, TransposedMomentum, batch, bitwise_equal, build_model,
                       matrix_param_groups, param_groups, train)
from zeroimpl import CPUOffload, ShardedOptimizer
from zeroimpl.checkpoint import (consolidated_optimizer_state_dict, export_fp32_state_dict, load_checkpoint,
                                 save_checkpoint)
from zeroimpl.checkpoint import CheckpointError
from zeroimpl.integrations.muon import hidden_matrices, split_hidden_matrices

WHOLE_ATOL = 1e-4
LOSS_ATOL = 1e-3
MUON_RTOL = 0.25
SIXTEEN_BIT_RTOL = 5e-2
CLIP = (0.05, float("inf"))  # the inf-norm (a max) is exact; the 2-norm is not (test_optimizer_clipping)
# (model, matrix optimizer, stage, offload, accumulation)
BITWISE = [("gpt2", "muon", 1, None, 1), ("gpt2", "muon", 2, None, 1), ("gpt2", "muon", 2, "cpu", 1),
           ("gpt2", "muon", 1, None, 2), ("gpt2", "muon", 1, "cpu", 2),
           ("llama", "muon", 1, None, 1), ("llama", "muon", 2, None, 1), ("llama", "muon", 2, "cpu", 1),
           ("gpt2", "adafactor", 1, None, 1), ("gpt2", "adafactor", 2, "cpu", 1), ("llama", "adafactor", 2, None, 1),
           ("gpt2", "normalized_sgd", 2, None, 1)]  # a class zeroimpl does not know, marked per_parameter


def _config(model, matrix_optimizer, stage, offload, accum, **extra):
    zero_kwargs = {} if offload is None else {"offload": CPUOffload(fused_step=False)}
    if matrix_optimizer == "normalized_sgd":
        zero_kwargs["per_parameter"] = [NormalizedSGD]
    return RunConfig(model, stage, accum=accum, clip=CLIP, matrix_optimizer=matrix_optimizer, zero_kwargs=zero_kwargs,
                     steps=5, **extra)


def _parity_runs(rank, world_size, cases):
    results = {}
    for case in cases:
        model, matrix_optimizer, stage, offload, accum = case
        results[case] = (train(_config(*case)), train(_config(model, matrix_optimizer, None, None, accum)))
    return results


@pytest.fixture(scope="module")
def world_size_2():
    return run_distributed(2, _parity_runs, BITWISE)


@pytest.mark.parametrize("case", BITWISE, ids=["-".join(map(str, case)) for case in BITWISE])
def test_bitwise_equal_to_ddp_with_the_same_optimizers_at_world_size_2(world_size_2, case):
    for by_rank in world_size_2:
        ours, reference = by_rank[case]
        assert bitwise_equal(ours, reference)
        initial = dict(build_model(case[0]).named_parameters())
        assert all(not torch.equal(value, initial[name]) for name, value in ours["params"].items()
                   if initial[name].requires_grad)  # every trainable parameter was stepped


def _assert_close(case, ours, reference):
    """See the module docstring: MUON_RTOL on Muon's matrices, WHOLE_ATOL elsewhere, LOSS_ATOL on losses."""
    for name, initial in build_model(case[0]).named_parameters():
        difference = ours["params"][name] - reference["params"][name]
        if case[1] == "muon":
            moved = (reference["params"][name] - initial.detach()).norm()
            assert difference.norm() <= MUON_RTOL * moved, name
        else:
            assert difference.abs().max() <= WHOLE_ATOL, name
    assert max(abs(a - b) for a, b in zip(ours["losses"], reference["losses"])) <= LOSS_ATOL


def test_stage2_accumulation_within_tolerance():
    """Stage 2 reduces each micro-batch as it completes, so it sums the micro-batches in another order than
    DDP: equal up to rounding only (as for flat shards)."""
    case = ("gpt2", "muon", 2, None, 2)
    for by_rank in run_distributed(2, _parity_runs, [case]):
        _assert_close(case, *by_rank[case])


@pytest.mark.parametrize("world_size,case", [(3, ("gpt2", "muon", 2, None, 1)), (4, ("llama", "muon", 1, None, 1)),
                                             (3, ("llama", "adafactor", 2, None, 1))])
def test_within_tolerance_at_world_sizes_3_and_4(world_size, case):
    for by_rank in run_distributed(world_size, _parity_runs, [case]):
        _assert_close(case, *by_rank[case])


def _sixteen_bit(rank, world_size):
    case = ("gpt2", "muon", 2, None, 2)
    return {dtype: train(_config(*case, dtype=dtype)) for dtype in (torch.float32, torch.bfloat16, torch.float16)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_models_track_the_fp32_run(dtype, sixteen_bit_runs):
    """bf16 / fp16 parameters with fp32 master shards (fp16: dynamic loss scaling) track the fp32 run of the
    same Muon + AdamW settings (stage 2, 2 micro-batches, 5 steps) within SIXTEEN_BIT_RTOL = 5e-2 in relative
    L2 over the model: measured 9.4e-3 for bf16 and 3.2e-3 for fp16 (tests/test_precision_mixed.py bounds
    AdamW alone by 3e-2; Muon's bf16 Newton-Schulz adds its own sensitivity, see the module docstring)."""
    for by_dtype in sixteen_bit_runs:
        ours, fp32 = by_dtype[dtype]["params"], by_dtype[torch.float32]["params"]
        difference = sum(((ours[n] - fp32[n]) ** 2).sum() for n in fp32) ** 0.5
        relative = (difference / sum((fp32[n] ** 2).sum() for n in fp32) ** 0.5).item()
        assert relative <= SIXTEEN_BIT_RTOL, relative


@pytest.fixture(scope="module")
def sixteen_bit_runs():
    return run_distributed(2, _sixteen_bit)


def test_an_unknown_non_elementwise_class_must_be_marked():
    model = build_model("gpt2")
    with pytest.raises(ValueError, match=r"per_parameter=\[NormalizedSGD\]"):
        ShardedOptimizer(matrix_param_groups(model, "normalized_sgd"), torch.optim.AdamW, lr=1e-2)


def _state_dict_round_trip(rank, world_size, kind):
    """state_dict() mid-run and load_state_dict() into a new optimizer: the resumed run is the uninterrupted one."""
    import copy

    def make():
        model = build_model("gpt2")
        optimizer = ShardedOptimizer(matrix_param_groups(model, kind), torch.optim.AdamW, stage=2, bucket_numel=4096,
                                     lr=1e-2)
        return model, optimizer

    model, optimizer = make()
    _train(model, optimizer, rank, range(2))
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    _train(model, optimizer, rank, range(2, 4))
    uninterrupted = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, optimizer = make()
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    _train(model, optimizer, rank, range(2, 4))
    return all(torch.equal(uninterrupted[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_state_dict_round_trip_resumes_bitwise(kind):
    assert all(run_distributed(2, _state_dict_round_trip, kind))


def _ownership(rank, world_size):
    """Each rank's inner optimizers: which parameters they hold (whole, in the parameter's shape)."""
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(matrix_param_groups(model, "muon"), torch.optim.AdamW, stage=2, bucket_numel=4096,
                                 lr=1e-2)
    matrices = {id(p) for p in hidden_matrices(model)}
    whole = [(piece.param_index, tuple(master.shape)) for piece, master, _ in optimizer.piece_states()
             if id(optimizer.trainable_params[piece.param_index]) in matrices]
    shapes = [tuple(p.shape) for p in optimizer.trainable_params]
    muon = optimizer.inner.optimizers[torch.optim.Muon]
    return {"whole": whole, "shapes": shapes, "muon_params": sum(len(g["params"]) for g in muon.param_groups),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def test_each_matrix_is_stepped_whole_by_exactly_one_rank():
    by_rank = run_distributed(2, _ownership)
    owned = [index for result in by_rank for index, _ in result["whole"]]
    assert sorted(owned) == sorted(set(owned)) and len(owned) == len(hidden_matrices(build_model("gpt2")))
    for result in by_rank:
        assert all(shape == result["shapes"][index] for index, shape in result["whole"])
        assert result["muon_params"] == len(result["whole"])
    groups = by_rank[0]["groups"]
    assert groups[0]["optimizer"] is torch.optim.Muon and groups[0]["lr"] == 0.02
    assert groups[0]["momentum"] == 0.95 and "betas" not in groups[0]  # Muon's defaults, not AdamW's kwargs
    assert groups[1]["optimizer"] is torch.optim.AdamW and groups[1]["lr"] == 1e-2


def _muon_on_a_vector(rank, world_size):
    model = build_model("gpt2")
    try:
        ShardedOptimizer([{"params": list(model.parameters()), "optimizer": torch.optim.Muon}], torch.optim.AdamW)
    except ValueError as error:
        return str(error)
    return None


def test_muon_refuses_non_matrices_on_every_rank():
    """Only one rank owns the bias; every rank must raise, or the others would hang in the first collective."""
    for message in run_distributed(2, _muon_on_a_vector):
        assert message is not None and "Muon only supports 2D parameters" in message


# -- checkpoints ---------------------------------------------------------------------------------------------
def _make(kind, per_parameter=()):
    if kind == "transposed_momentum":
        per_parameter = (TransposedMomentum,)
    model = build_model("gpt2")
    groups = param_groups(model) if kind == "adamw" else matrix_param_groups(model, kind)
    return model, ShardedOptimizer(groups, torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-2,
                                   per_parameter=per_parameter)


def _train(model, optimizer, rank, steps):
    for step in steps:
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        optimizer.step()
        optimizer.zero_grad()


def _save(rank, world_size, root, kind, per_parameter=()):
    model, optimizer = _make(kind, per_parameter)
    _train(model, optimizer, rank, range(3))
    save_checkpoint(os.path.join(root, f"{kind}-{world_size}"), optimizer, model)
    return [bucket.whole for bucket in optimizer.layout.buckets]


def _reshard(rank, world_size, root, kind, per_parameter):
    """Load at another world size (and layout), save again: the state must survive unchanged."""
    model, optimizer = _make(kind, per_parameter)
    load_checkpoint(os.path.join(root, f"{kind}-2"), optimizer, model)
    save_checkpoint(os.path.join(root, f"{kind}-{world_size}-resaved"), optimizer, model)
    _train(model, optimizer, rank, range(3, 4))  # the loaded state has the shapes the optimizer expects
    return [bucket.whole for bucket in optimizer.layout.buckets]


def _refuse_flat(rank, world_size, root):
    model = build_model("gpt2")
    plain = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=4096, lr=1e-2)
    try:
        load_checkpoint(os.path.join(root, "adafactor-2"), plain, model)
    except CheckpointError as error:
        return str(error)
    return None


def _assert_same_state(a: dict, b: dict):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for number, state in a["state"].items():
        assert state.keys() == b["state"][number].keys()
        for key, value in state.items():
            other = b["state"][number][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other


ADAMW_WHOLE = (torch.optim.AdamW,)


@pytest.mark.parametrize("kind,world_size,saved_per_parameter,per_parameter", [
    ("muon", 3, (), ()), ("muon", 1, (), ()), ("adafactor", 4, (), ()),
    ("transposed_momentum", 3, (), ()),  # a state of the parameter's size but not its shape: moved whole
    ("adamw", 3, (), ADAMW_WHOLE),  # flat shards saved, whole-parameter shards loaded
    ("adamw", 4, ADAMW_WHOLE, ()),  # and back
])
def test_checkpoints_reshard_bit_for_bit(tmp_path, kind, world_size, saved_per_parameter, per_parameter):
    saved_wholes = run_distributed(2, _save, str(tmp_path), kind, saved_per_parameter)[0]
    wholes = run_distributed(world_size, _reshard, str(tmp_path), kind, per_parameter)[0]
    assert any(saved_wholes + wholes) and not (all(saved_wholes) and all(wholes))
    saved = consolidated_optimizer_state_dict(os.path.join(tmp_path, f"{kind}-2"))
    resaved = consolidated_optimizer_state_dict(os.path.join(tmp_path, f"{kind}-{world_size}-resaved"))
    _assert_same_state(saved, resaved)
    if kind == "adafactor":  # factored second moments moved whole
        assert any("row_var" in state for state in saved["state"].values())


def test_whole_parameter_state_is_not_loaded_into_flat_shards(tmp_path):
    run_distributed(2, _save, str(tmp_path), "adafactor")
    for message in run_distributed(2, _refuse_flat, str(tmp_path)):
        assert message is not None and "optimizer classes" in message


def _export(rank, world_size, root):
    """The exported state of each class loads into that plain torch optimizer, which then steps as the
    sharded one does."""
    model, optimizer = _make("muon")
    _train(model, optimizer, rank, range(3))
    directory = os.path.join(root, "export")
    save_checkpoint(directory, optimizer, model)
    _train(model, optimizer, rank, range(3, 4))
    sharded = {n: p.detach().clone() for n, p in model.named_parameters()}

    plain_model = build_model("gpt2")
    plain_model.load_state_dict(export_fp32_state_dict(directory))
    groups = matrix_param_groups(plain_model, "muon")
    muon = torch.optim.Muon([{k: v for k, v in groups[0].items() if k != "optimizer"}])
    adamw = torch.optim.AdamW(groups[1:], lr=1e-2)
    muon.load_state_dict(consolidated_optimizer_state_dict(directory, groups=[0]))
    adamw.load_state_dict(consolidated_optimizer_state_dict(directory, groups=[1, 2]))
    ddp = torch.nn.parallel.DistributedDataParallel(plain_model)
    ddp(**batch(rank, 3, 0)).loss.backward()
    for plain in (muon, adamw):
        plain.step()
    return max((sharded[n] - p.detach()).abs().max().item() for n, p in plain_model.named_parameters())


def test_export_to_the_plain_torch_optimizers(tmp_path):
    for difference in run_distributed(2, _export, str(tmp_path)):
        assert difference == 0.0


# -- layout at scale (meta-device models: shapes only) ---------------------------------------------------------
def _muon_layout(model_name: str, world_size: int):
    import transformers

    from zeroimpl.layout import build_layout, trainable_specs
    from zeroimpl.optimizer_kinds import step_work

    configs = {"gpt2-124m": (transformers.GPT2LMHeadModel, transformers.GPT2Config()),
               "tinyllama-1.1b": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
                   hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                   num_key_value_heads=4, vocab_size=32000))}
    model_class, config = configs[model_name]
    with torch.device("meta"):
        model = model_class(config)
    matrices, rest = split_hidden_matrices(model, [{"params": list(model.parameters())}])
    groups = [{"params": matrices}] + rest
    _, specs = trainable_specs(groups, [step_work(torch.optim.Muon), None])
    return build_layout(specs, world_size, 2 ** 22), specs


@pytest.mark.parametrize("model_name", ["gpt2-124m", "tinyllama-1.1b"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_default_buckets_pad_at_most_5_percent_and_balance_newton_schulz(model_name, world_size):
    """The issue's bound: padding (carried by the reduce-scatter and the all-gather) <= 5% of Ψ with default
    buckets; and each rank runs about 1/N of the Newton-Schulz flops (here within 2% of the mean)."""
    layout, specs = _muon_layout(model_name, world_size)
    assert layout.padded_numel - layout.numel <= 0.05 * layout.numel
    work = [sum(specs[p.param_index].work for p in layout.pieces(r)) for r in range(world_size)]
    assert max(work) <= 1.02 * sum(work) / world_size
    for bucket in layout.buckets:
        if bucket.whole:  # whole parameters: each in exactly one shard
            for index in bucket.param_indices:
                slot = layout.slots[index]
                assert slot.offset // bucket.shard_numel == (slot.end - 1) // bucket.shard_numel
