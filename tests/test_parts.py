"""In-process unit tests of the step's parts that need no process group: the inner optimizers over pieces, the
gradient stores and the step's loss-scaling facts. Each names the rule it checks; the references are
torch's own optimizers and plain tensor arithmetic."""

from __future__ import annotations

import pytest
import torch

from zeroimpl.buffers import flatten_params
from zeroimpl.grad_shards import DeviceGradientShards, HostGradientShards, ShardFill
from zeroimpl.inner import InnerOptimizers, PieceMasters, step_pieces
from zeroimpl.layout import ParamSpec, build_layout
from zeroimpl.step_checks import loss_scaling_misuse


def _params(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in shapes]


def _grads_like(params, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) for p in params]


# -- inner optimizers ----------------------------------------------------------------------------------
def test_inner_optimizers_number_state_as_one_torch_optimizer_over_the_same_groups():
    """Two classes, groups interleaved (AdamW, SGD, AdamW): state_dict numbers the tensors through the groups
    in order, as one torch optimizer over the same groups would, and a round trip restores every value."""
    params = _params([(3,), (4,), (5,), (2,)])
    groups = [{"params": [params[0]], "lr": 0.1}, {"params": [params[1]], "lr": 0.2, "momentum": 0.9},
              {"params": params[2:], "lr": 0.3}]
    classes = [torch.optim.AdamW, torch.optim.SGD, torch.optim.AdamW]
    inner = InnerOptimizers(groups, classes, {torch.optim.AdamW: {}, torch.optim.SGD: {}})
    assert [g["lr"] for g in inner.param_groups] == [0.1, 0.2, 0.3]
    for p, g in zip(params, _grads_like(params)):
        p.grad = g
    inner.step()
    saved = inner.state_dict()
    assert [g["params"] for g in saved["param_groups"]] == [[0], [1], [2, 3]]
    assert torch.equal(saved["state"][1]["momentum_buffer"], params[1].grad)  # SGD's first step: the gradient
    assert set(saved["state"][3]) == {"step", "exp_avg", "exp_avg_sq"}
    fresh = InnerOptimizers(groups, classes, {torch.optim.AdamW: {}, torch.optim.SGD: {}})
    fresh.load_state_dict(saved)
    again = fresh.state_dict()
    for number, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(again["state"][number][key]), torch.as_tensor(value)), (number, key)


def test_one_class_states_exactly_as_the_torch_optimizer_itself():
    params, twins = _params([(3,), (4,)]), _params([(3,), (4,)])
    inner = InnerOptimizers([{"params": params, "lr": 0.1}], [torch.optim.AdamW], {torch.optim.AdamW: {}})
    reference = torch.optim.AdamW([{"params": twins, "lr": 0.1}])
    for p, twin, g in zip(params, twins, _grads_like(params)):
        p.grad, twin.grad = g, g.clone()
    inner.step()
    reference.step()
    ours, theirs = inner.state_dict(), reference.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert all(torch.equal(ours["state"][n][k], theirs["state"][n][k]) for n in theirs["state"] for k in theirs["state"][n])


def test_stepping_pieces_in_parts_is_bitwise_stepping_them_at_once():
    """The offload pipeline steps bucket by bucket: for AdamW that must equal one step over all pieces."""
    shapes = [(7,), (5,), (3,)]
    results = []
    for parts in ([[0, 1, 2]], [[0], [1, 2]], [[2], [0], [1]]):
        params = _params(shapes)
        inner = InnerOptimizers([{"params": params}], [torch.optim.AdamW], {torch.optim.AdamW: {"lr": 0.1}})
        grads = _grads_like(params)
        for _ in range(3):
            for part in parts:
                step_pieces(inner, [(params[i], grads[i]) for i in part])
        results.append([p.detach().clone() for p in params])
        assert all(p.grad is None for p in params)  # the views' gradients are not kept
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_piece_masters_view_the_master_shard_and_skip_pieces_without_a_gradient():
    params = _params([(6,), (4, 2), (3,)])
    layout = build_layout([ParamSpec(0, str(p.dtype), p.numel()) for p in params], world_size=2,
                          bucket_numel=1 << 10, alignment=1)
    storages = flatten_params(layout, params, rank=1)
    pieces = PieceMasters(layout, layout.pieces(1), storages, params)
    for piece, master in zip(pieces.pieces, pieces.masters):
        shard = storages[piece.bucket_index].master
        assert master.data_ptr() == shard[piece.shard_offset:].data_ptr() and master.numel() == piece.length
    grads = [torch.arange(s.master.numel(), dtype=torch.float32) for s in storages]
    stepped = [index != pieces.pieces[0].param_index for index in range(len(params))]
    pairs = pieces.gradient_pairs(grads, stepped)
    paired = [master for bucket in pairs.values() for master, _ in bucket]
    assert all(m is not pieces.masters[0] for m in paired) and len(paired) == len(pieces.pieces) - 1
    for bucket in pairs.values():
        for master, grad in bucket:
            piece = pieces.pieces[next(i for i, m in enumerate(pieces.masters) if m is master)]
            assert torch.equal(grad, grads[piece.bucket_index][piece.shard_offset:piece.shard_offset + piece.length])
    zeros = pieces.gradient_pairs([None] * len(storages), None)  # zero_grad(set_to_none=False): zeros, stepped
    assert all(torch.equal(g, torch.zeros_like(m)) for bucket in zeros.values() for m, g in bucket)


# -- gradient stores -------------------------------------------------------------------------------------
def test_device_store_takes_the_first_reduction_as_is_and_sums_the_rest():
    store = DeviceGradientShards(2)
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25])
    store.add(1, first)
    assert store.ready()[1] is first and store.ready()[0] is None and store.has_gradients
    store.add(1, second)
    assert torch.equal(store.ready()[1], torch.tensor([1.5, 2.25]))
    store.clear(set_to_none=False)
    assert torch.equal(store.ready()[1], torch.zeros(2)) and store.ready()[0] is None
    store.clear(set_to_none=True)
    assert not store.has_gradients


def test_host_store_moves_device_sums_over_when_ready_is_called_inside_accumulating():
    """step() inside accumulating(): the sums kept on the device must reach the host shards, not be dropped."""
    store = HostGradientShards(torch.device("cpu"), [torch.zeros(2), torch.zeros(3)])
    with store.accumulating():
        store.add(0, torch.tensor([1.0, 2.0]))
        store.add(0, torch.tensor([1.0, 1.0]))
        store.add(1, torch.tensor([3.0, 0.0, 1.0]))
        assert store.has_gradients and store.device_tensors()
        ready = store.ready()
    assert torch.equal(ready[0], torch.tensor([2.0, 3.0])) and torch.equal(ready[1], torch.tensor([3.0, 0.0, 1.0]))
    assert not store.device_tensors()


def test_host_store_sums_filled_shards_and_overwrites_zeroed_ones():
    store = HostGradientShards(torch.device("cpu"), [torch.zeros(2)])
    store.add(0, torch.tensor([1.0, 1.0]))
    store.add(0, torch.tensor([2.0, 0.0]))  # not accumulating: summed on the host
    assert torch.equal(store.ready()[0], torch.tensor([3.0, 1.0]))
    store.clear(set_to_none=False)  # a zero gradient that the next reduction replaces
    assert torch.equal(store.ready()[0], torch.zeros(2)) and store.has_gradients
    store.add(0, torch.tensor([5.0, 6.0]))
    assert torch.equal(store.ready()[0], torch.tensor([5.0, 6.0]))
    store.clear(set_to_none=True)
    assert store.ready() == [None] and not store.has_gradients


def test_host_store_fill_states_follow_their_rules():
    store = HostGradientShards(torch.device("cpu"), [torch.zeros(1), torch.zeros(1)])
    store.add(0, torch.ones(1))
    store.clear(set_to_none=False)
    ready = store.ready()  # ZEROED: a zero gradient, stepped as zeros; EMPTY stays empty: not stepped
    assert torch.equal(ready[0], torch.zeros(1)) and ready[1] is None
    assert [fill.value for fill in ShardFill] == ["empty", "filled", "zeroed"]


def test_accumulating_restores_the_previous_setting_even_on_error():
    store = HostGradientShards(torch.device("cpu"), [torch.zeros(1)])
    with pytest.raises(ValueError):
        with store.accumulating():
            with store.accumulating():
                pass
            store.add(0, torch.ones(1))
            assert store.device_tensors()  # still accumulating: kept on the device
            raise ValueError
    store.add(0, torch.ones(1))  # no longer: the sum crosses to the host
    assert not store.device_tensors() and torch.equal(store.ready()[0], torch.full((1,), 2.0))


# -- step facts ----------------------------------------------------------------------------------------------
def test_loss_scaling_refuses_an_unscaled_loss_and_a_backward_after_unscaling():
    assert "optimizer.backward(loss)" in loss_scaling_misuse(loss_scaled=False, unscaled=False)
    assert "between clip_grad_norm_" in loss_scaling_misuse(loss_scaled=True, unscaled=True)
    assert loss_scaling_misuse(loss_scaled=True, unscaled=False) is None



def test_checkpoint_functions_refuse_swapped_arguments_by_name():
    from zeroimpl.checkpoint import load_checkpoint, save_checkpoint
    model = torch.nn.Linear(2, 2)
    for function in (save_checkpoint, load_checkpoint):
        with pytest.raises(TypeError, match=r"\(directory, optimizer, model\).*got Linear and Linear"):
            function("unused", model, model)
