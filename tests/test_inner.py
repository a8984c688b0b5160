"""The inner optimizers over this rank's pieces (zeroimpl.inner), in process: they number their state as one torch
optimizer over the same groups, step a piece as torch steps it, and follow the outer groups' hyperparameters.
References: torch's own optimizers."""

import torch

from zeroimpl.buffers import flatten_params
from zeroimpl.inner import InnerOptimizers, PieceMasters, step_pieces
from zeroimpl.layout import ParamSpec, build_layout


def _params(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for shape in shapes]


def _grads_like(params, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) for p in params]


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


def test_follow_takes_only_changed_outer_values_so_a_users_betas_outlive_an_old_momentum():
    """SGD (momentum) and AdamW (betas) groups: a momentum written once into the AdamW group goes to betas[0];
    betas the user sets afterwards must win, because that momentum did not change since."""
    sgd_param, adamw_param = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    outer = [{"params": [sgd_param], "lr": 0.1, "momentum": 0.9}, {"params": [adamw_param], "lr": 0.01}]
    inner = InnerOptimizers([{"params": [sgd_param]}, {"params": [adamw_param]}], [torch.optim.SGD, torch.optim.AdamW],
                            {torch.optim.SGD: {"lr": 0.1, "momentum": 0.9}, torch.optim.AdamW: {"lr": 0.01}})
    inner.report(outer)  # (as construction does: the defaults the outer groups left out)
    outer[1]["momentum"] = 0.8  # a momentum scheduler over both classes writes `momentum` into every group
    inner.follow(outer)
    assert inner.param_groups[1]["betas"][0] == 0.8
    inner.report(outer)  # (after the step)
    outer[1]["betas"] = (0.5, 0.99)  # then the user sets betas directly
    inner.follow(outer)
    assert inner.param_groups[1]["betas"] == (0.5, 0.99)
    assert inner.param_groups[0]["momentum"] == 0.9  # unchanged outer values change nothing

def _run_of(sizes, optimizer_class, kwargs):
    """Pieces of ``sizes`` laid end to end in one master (a run), their InnerOptimizers, and per-piece twins stepped
    by torch's ``optimizer_class`` itself (the reference)."""
    master = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0))
    pieces = list(master.split(sizes))
    twins = [torch.nn.Parameter(piece.clone()) for piece in pieces]
    inner = InnerOptimizers([{"params": pieces}], [optimizer_class], {optimizer_class: kwargs},
                            runs=[(pieces, master)])
    return master, pieces, inner, optimizer_class(twins, **kwargs), twins


def _step_both(pieces, inner, reference, twins, seed, skipped=()):
    for index, (piece, twin, grad) in enumerate(zip(pieces, twins, _grads_like(pieces, seed))):
        piece.grad, twin.grad = (None, None) if index in skipped else (grad, grad.clone())
    inner.step()
    reference.step()
    for piece in pieces:
        piece.grad = None


def test_a_run_of_pieces_steps_as_one_tensor_bitwise_as_each_piece_alone_until_a_step_leaves_one_out():
    """AdamW and SGD with momentum: the run steps as one tensor (one state, each piece's a view of it, the step
    counters one tensor, exported as copies), bitwise torch's per-tensor steps; a step without one piece's gradient
    splits it for good (each piece its own counter), still bitwise."""
    for optimizer_class, kwargs in ((torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1}),
                                    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})):
        master, pieces, inner, reference, twins = _run_of([5, 3, 17, 1], optimizer_class, kwargs)
        for seed in range(3):
            _step_both(pieces, inner, reference, twins, seed)
        run = inner.runs[0]
        assert run.state is not None and all(torch.equal(p, t) for p, t in zip(pieces, twins)), optimizer_class
        buffer = next(v for v in run.state.values() if torch.is_tensor(v) and v.dim())
        assert all(next(v for v in inner.optimizers[optimizer_class].state[p].values() if torch.is_tensor(v) and
                        v.dim()).data_ptr() == buffer[start:].data_ptr() for p, (start, _) in zip(pieces, run.bounds))
        if optimizer_class is torch.optim.AdamW:
            steps = [state["step"] for state in inner.state_dict()["state"].values()]
            assert len({id(step) for step in steps}) == len(steps) and all(step.item() == 3 for step in steps)
        _step_both(pieces, inner, reference, twins, 3, skipped={1})
        assert run.state is None
        for seed in range(4, 6):
            _step_both(pieces, inner, reference, twins, seed)
        assert all(torch.equal(p, t) for p, t in zip(pieces, twins)), optimizer_class


def test_a_loaded_run_steps_as_one_again_and_a_fused_kernel_never_runs_one():
    """A state saved from a run and loaded into a fresh one makes it one again (its tensors joined without a copy),
    and going on is bitwise going on without the round trip; torch's fused CPU kernels (not bitwise over a run) and
    classes outside torch's elementwise ones get no run."""
    sizes, kwargs = [4, 9, 2], {"lr": 0.1}
    master, pieces, inner, reference, twins = _run_of(sizes, torch.optim.AdamW, kwargs)
    for seed in range(2):
        _step_both(pieces, inner, reference, twins, seed)
    loaded, loaded_pieces, fresh, _, _ = _run_of(sizes, torch.optim.AdamW, kwargs)
    loaded.copy_(master)
    saved = inner.state_dict()
    fresh.load_state_dict(saved)  # (torch's load keeps the saved tensors: here views of the run's state)
    for seed in range(2, 4):
        _step_both(loaded_pieces, fresh, reference, twins, seed)
        assert fresh.runs[0].state["step"].item() == seed + 1  # one again, from the saved counters on
    assert all(torch.equal(p, t) for p, t in zip(loaded_pieces, twins))
    joined = fresh.runs[0].state["exp_avg"]  # joined without a copy: the saved tensors lie end to end
    assert joined.untyped_storage().data_ptr() == saved["state"][0]["exp_avg"].untyped_storage().data_ptr()
    assert not _run_of(sizes, torch.optim.AdamW, {"fused": True})[2].runs

    class MyAdamW(torch.optim.AdamW):
        pass
    assert not _run_of(sizes, MyAdamW, {})[2].runs


def test_a_runs_state_stays_the_pieces_state_through_saves_and_loads_that_bypass_it():
    """A saved state holds the live tensors, as torch's does (its step counter too); and a load that reaches the
    pieces' states without the run (torch's own load of one class, as a load failing part-way leaves it) is what the
    next step steps from."""
    sizes, kwargs = [4, 9, 2], {"lr": 0.1}
    master, pieces, inner, reference, twins = _run_of(sizes, torch.optim.AdamW, kwargs)
    _step_both(pieces, inner, reference, twins, 0)
    saved = inner.state_dict()
    _step_both(pieces, inner, reference, twins, 1)
    assert [state["step"].item() for state in saved["state"].values()] == [2.0] * len(sizes)
    elsewhere = torch.optim.AdamW([torch.nn.Parameter(t.detach().clone()) for t in twins], **kwargs)
    for twin, grad in zip(elsewhere.param_groups[0]["params"], _grads_like(twins, 7)):
        twin.grad = grad
    elsewhere.step()  # another history: one step, other moments
    inner.optimizers[torch.optim.AdamW].load_state_dict(elsewhere.state_dict())
    reference.load_state_dict(elsewhere.state_dict())
    _step_both(pieces, inner, reference, twins, 2)
    assert all(torch.equal(p, t) for p, t in zip(pieces, twins))
    assert inner.runs[0].state["step"].item() == 2


def test_a_run_whose_pieces_saved_different_states_loads_split_and_a_stateless_class_exports_none():
    """Second review: a piece that never stepped (no gradient yet) saves no state; loaded beside its run's other
    pieces, the next steps split the run and go on bitwise (they raised at every step); and a class that keeps no
    state (SGD without momentum) exports none, as torch does."""
    sizes, kwargs = [4, 9, 2], {"lr": 0.1}
    master, pieces, inner, reference, twins = _run_of(sizes, torch.optim.AdamW, kwargs)
    _step_both(pieces, inner, reference, twins, 0, skipped={1})
    loaded, loaded_pieces, fresh, _, _ = _run_of(sizes, torch.optim.AdamW, kwargs)
    loaded.copy_(master)
    fresh.load_state_dict(inner.state_dict())
    for seed in range(1, 3):
        _step_both(loaded_pieces, fresh, reference, twins, seed)
    assert fresh.runs[0].state is None and all(torch.equal(p, t) for p, t in zip(loaded_pieces, twins))
    _, pieces, inner, reference, twins = _run_of(sizes, torch.optim.SGD, kwargs)
    _step_both(pieces, inner, reference, twins, 0)
    assert inner.state_dict()["state"] == reference.state_dict()["state"] == {}
