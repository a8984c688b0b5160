"""CPU offload against the same run without offload, at world sizes 1-3, fp32 and bf16.

Every run: tiny GPT-2, two param groups, a frozen parameter, LambdaLR, clipping to norm 1.0 and two
micro-batches per step, so the parity covers clipping, accumulation and the schedule together.

Offload computes the same operations in the same order, only in other memory, so with the same CPU kernel
the results are **bitwise** equal, fp32 and bf16 alike, with and without the ``accumulating()`` hint:
* offload with ``fused=False`` against no offload with torch's default (for-loop) CPU kernel;
* offload's default host step (torch's fused CPU kernel) against no offload with ``fused=True``.
The fused kernel itself rounds differently from the for-loop kernel in the last bit; after 4 AdamW steps
at lr 1e-2 that moves parameters by up to 1.3e-5 (measured), checked against the core tests' Adam
tolerance KERNEL_ATOL = 1e-4 (Adam turns a last-bit difference in a near-zero gradient into up to lr);
in bf16 the kernels are not compared (a last-bit master difference can flip a rounding of the weights).
"""

import mmap
from functools import partial

import pytest
import torch

from distributed import case_results, run_cases, run_distributed
from workloads import RunConfig, batch, bitwise_equal, build_model, max_param_diff, param_groups, train
from zeroimpl import CPUOffload, ShardedOptimizer
from zeroimpl.layout import ParamSpec, build_layout
from zeroimpl.offload import FUSED_CPU_OPTIMIZERS, host_buffers, host_optimizer_kwargs, resolve_offload, staging_sizes

CPU = torch.device("cpu")

KERNEL_ATOL = 1e-4
SAME_KERNEL = {"offload": "cpu", "fused": False}


def _parity_runs(rank, world_size, dtypes):
    results = {}
    for dtype in dtypes:
        for stage in (1, 2):
            def run(**options):
                hint = options.pop("hint", False)
                return train(RunConfig("gpt2", stage, accum=2, clip=(1.0, 2.0), dtype=dtype,
                                       zero_kwargs=options, hint_accumulation=hint))
            results[(dtype, stage, "reference")] = run()
            results[(dtype, stage, "offload")] = run(**SAME_KERNEL)
            results[(dtype, stage, "offload+hint")] = run(**SAME_KERNEL, hint=True)
            results[(dtype, stage, "reference fused")] = run(fused=True)
            results[(dtype, stage, "offload fused")] = run(offload="cpu")
    return results


def _assert_parity(results, dtype):
    for stage in (1, 2):
        reference = results[(dtype, stage, "reference")]
        assert bitwise_equal(results[(dtype, stage, "offload")], reference), (dtype, stage)
        assert bitwise_equal(results[(dtype, stage, "offload+hint")], reference), (dtype, stage)
        fused = results[(dtype, stage, "offload fused")]
        assert bitwise_equal(fused, results[(dtype, stage, "reference fused")]), (dtype, stage)
        if dtype == torch.float32:  # (in bf16 a last-bit master difference can flip a rounding of the weights)
            assert 0 < max_param_diff(fused["params"], reference["params"]) <= KERNEL_ATOL  # another kernel


@pytest.fixture(scope="module")
def world_size_2():
    """Every check at world size 2 in one launch of 2 ranks (``_world_size_2`` at the end of this file), one
    case per test (``run_cases``: a case that raises fails its own test only); each configuration builds its
    own model and optimizer."""
    return run_distributed(2, _world_size_2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_matches_no_offload_at_world_size_2(world_size_2, dtype):
    for rank_results in case_results(world_size_2, ("parity", dtype)):
        _assert_parity(rank_results, dtype)


@pytest.mark.parametrize("world_size", [1, 3])
def test_offload_matches_no_offload_at_other_world_sizes(world_size):
    for rank_results in run_distributed(world_size, _parity_runs, (torch.float32,)):
        _assert_parity(rank_results, torch.float32)


def _hint_memory(rank, world_size):
    """Device bytes of the gradient shard through one step of 3 micro-batches, stage 2 with offload."""
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, offload="cpu",
                                 bucket_numel=4096, lr=1e-3)
    seen = []
    for micro in range(3):
        if micro < 2:
            with optimizer.accumulating():
                optimizer.backward(model(**batch(rank, 0, micro)).loss)
        else:
            optimizer.backward(model(**batch(rank, 0, micro)).loss)
        seen.append(optimizer.memory_report().device.gradient_shard)
    return seen, optimizer.layout.padded_numel // world_size


def _host_arena(rank, world_size):
    """Where the host masters, gradient shards and (bf16 model) staging buffers live: the arena bytes against
    the report's host bytes, and whether every one of them is a slice of an arena."""
    model = build_model("gpt2", torch.bfloat16)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, offload="cpu",
                                 bucket_numel=4096, lr=1e-3)
    optimizer.backward(model(**batch(rank, 0, 0)).loss)
    report = optimizer.memory_report().host
    spans = [(a.start, a.start + a.nbytes) for a in optimizer.host_arenas]
    held = optimizer.held_tensors()
    host_tensors = [s.master for s in optimizer.storages] + held["host_gradient_shard"] + held["host_staging"]
    inside = all(any(low <= t.data_ptr() < high for low, high in spans) for t in host_tensors)
    return (sum(a.nbytes for a in optimizer.host_arenas),
            report.master_weights + report.gradient_shard + report.bucket_buffers, inside, len(held["host_staging"]))


class _MixedDtypes(torch.nn.Module):
    """Layers in bf16 and fp16 by turns: with one layer a bucket, the buckets' dtypes alternate."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32, bias=False).to(dtype)
                                          for dtype in (torch.bfloat16, torch.float16) * 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x.to(layer.weight.dtype)))
        return x.float().square().mean()


def _mixed_dtypes(rank, world_size):
    """Offload against no offload on a model whose buckets alternate bf16 and fp16 (bitwise), and whether
    every staging buffer carried a bucket (each dtype takes its two buffers in turn)."""
    results = []
    for offload in (None, CPUOffload(fused_step=False)):
        model = _MixedDtypes()
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, offload=offload,
                                     bucket_numel=1024, loss_scale=None, lr=1e-2)
        for step in range(3):
            optimizer.backward(model(torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))))
            optimizer.step()
            optimizer.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    staging = optimizer.held_tensors()["host_staging"]
    return (all(torch.equal(a, b) for a, b in zip(*results)), len(staging),
            all(bool(t.float().abs().sum() > 0) for t in staging))


def _pipeline_order(rank, world_size):
    """The order of host steps and all-gathers inside one offloaded step() (observed by wrapping both)."""
    from zeroimpl import comm

    model = build_model("gpt2", torch.bfloat16)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, offload="cpu",
                                 bucket_numel=4096, lr=1e-3)
    optimizer.backward(model(**batch(rank, 0, 0)).loss)
    events, inner_step, all_gather = [], optimizer.inner.step, comm.all_gather
    optimizer.inner.step = lambda: (events.append("step"), inner_step())
    comm.all_gather = lambda *args, **kwargs: (events.append("gather"), all_gather(*args, **kwargs))[1]
    try:
        optimizer.step()
    finally:
        comm.all_gather = all_gather
    return events, len(optimizer.layout.buckets)


def test_offload_steps_bucket_by_bucket_each_gathered_before_the_next_steps(world_size_2):
    """The host step runs per bucket, and each bucket's all-gather is queued before the next bucket steps:
    the next host step overlaps the copy and the all-gather (a bucket whose pieces on this rank are all
    padding has no step)."""
    for events, buckets in case_results(world_size_2, "pipeline"):
        assert events.count("gather") == buckets and events.count("step") > 1
        assert all(b == "gather" for a, b in zip(events, events[1:]) if a == "step")  # its own bucket's
        last_step = len(events) - 1 - events[::-1].index("step")
        assert events.index("gather") < last_step  # gathers start before the host steps end


def test_staging_buffers_of_each_dtype_take_turns(world_size_2):
    for same, buffers, all_used in case_results(world_size_2, "mixed_dtypes"):
        assert same and buffers == 4 and all_used


def test_host_buffers_share_one_arena_of_whole_pages(world_size_2):
    """One allocation (page-locked on CUDA) holds them all, and it is what memory_report counts rounded up to
    whole pages."""
    for arena_bytes, reported, inside, staging in case_results(world_size_2, "host_arena"):
        assert 0 < reported <= arena_bytes < reported + mmap.PAGESIZE and arena_bytes % mmap.PAGESIZE == 0
        assert inside and staging == 2


def test_accumulating_sums_on_the_device_and_crosses_once(world_size_2):
    for seen, shard_numel in case_results(world_size_2, "hint_memory"):
        assert seen == [4 * shard_numel, 4 * shard_numel, 0]


def _host_syncs(rank, world_size, dtype, bucket_numel):
    """Calls that make the host wait for a tensor's value, counted over clip + step."""
    model = build_model("gpt2", dtype)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, offload="cpu",
                                 bucket_numel=bucket_numel, lr=1e-3)
    counted = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu")
    originals = {name: getattr(torch.Tensor, name) for name in counted}
    calls = []

    def counting(name):
        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return originals[name](self, *args, **kwargs)
        return wrapper

    per_step = []
    for step in range(2):
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        for name in counted:
            setattr(torch.Tensor, name, counting(name))
        try:
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        per_step.append(list(calls))
        calls.clear()
        optimizer.zero_grad()
    return per_step, len(optimizer.layout.buckets)


def _host_syncs_few_and_many_buckets(rank, world_size, dtype):
    return [_host_syncs(rank, world_size, dtype, bucket_numel) for bucket_numel in (2 ** 20, 1)]


HOST_SYNC_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", HOST_SYNC_DTYPES)
def test_host_syncs_per_step_do_not_grow_with_buckets(world_size_2, dtype):
    """One host sync in clip + step, the step's agreed checks (NaN/Inf, backward counts), with 2 or 20+
    buckets."""
    expected = ["tolist"]
    for (few, few_buckets), (many, many_buckets) in case_results(world_size_2, ("host_syncs", dtype)):
        assert few_buckets == 2 and many_buckets >= 20  # one bucket per param group; one per parameter
        assert few == many == [expected, expected]


def _edited_params(rank, world_size, dtype, offload):
    """Parameters zeroed by hand between steps must stay zero through an SGD step with lr 0: the optimizer
    takes the edit into its master weights instead of writing the stale master back."""
    model = build_model("gpt2", dtype)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.SGD, stage=2, offload=offload, lr=0.0)
    for step in range(2):
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
    return all(torch.count_nonzero(p) == 0 for p in model.parameters() if p.requires_grad)


EDITED_CASES = [(torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.bfloat16, None)]


@pytest.mark.parametrize("dtype,offload", EDITED_CASES)
def test_parameters_edited_outside_the_optimizer_are_kept(world_size_2, dtype, offload):
    assert case_results(world_size_2, ("edited", dtype, offload)) == [True, True]


def _any_optimizer(rank, world_size, optimizer_name):
    """Offload works with every elementwise optimizer, not only Adam (DeepSpeed refuses client optimizers)."""
    optimizer_class, kwargs = {"rmsprop": (torch.optim.RMSprop, {"lr": 1e-3}),
                               "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
                               "nadam": (torch.optim.NAdam, {"lr": 1e-3})}[optimizer_name]
    finals = []
    for offload in (None, CPUOffload(fused_step=False)):
        model = build_model("gpt2")
        optimizer = ShardedOptimizer(param_groups(model), optimizer_class, stage=2, offload=offload, **kwargs)
        for step in range(3):
            optimizer.backward(model(**batch(rank, step, 0)).loss)
            optimizer.step()
            optimizer.zero_grad()
        finals.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return all(torch.equal(finals[0][n], finals[1][n]) for n in finals[0])


OTHER_OPTIMIZERS = ["rmsprop", "adagrad", "nadam"]


@pytest.mark.parametrize("optimizer_name", OTHER_OPTIMIZERS)
def test_offload_with_other_optimizers_is_bitwise(world_size_2, optimizer_name):
    assert case_results(world_size_2, ("other_optimizers", optimizer_name)) == [True, True]


def _edits_before_save_and_per_parameter(rank, world_size):
    """(1) Weights loaded into the model after the optimizer was built are what state_dict() saves, before
    any step. (2) Editing one parameter re-syncs only that parameter's slice of the bf16 master weights."""
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, offload="cpu", lr=1e-2)
    with torch.no_grad():
        model.load_state_dict({n: t + 0.5 for n, t in model.state_dict().items()})
    saved_masters = optimizer.state_dict()["master_weights"]
    before_save = all(torch.equal(m, s.shard) for m, s in zip(saved_masters, optimizer.storages))

    model = build_model("gpt2", torch.bfloat16)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=2 ** 20, lr=1e-2)
    optimizer.backward(model(**batch(rank, 0, 0)).loss)
    optimizer.step()  # the fp32 masters now hold more than the bf16 parameters
    masters = [s.master.clone() for s in optimizer.storages]
    edited = model.transformer.h[0].ln_1.bias
    with torch.no_grad():
        edited.zero_()
    optimizer.sync_masters()
    changed = [(m != s.master).nonzero().flatten() for m, s in zip(masters, optimizer.storages)]
    storage = next(s for s in optimizer.storages if any(p is edited for p in s.params))
    offset = sum(p.numel() for p in storage.params[:[p is edited for p in storage.params].index(True)])
    start = storage.shard.storage_offset() - storage.param_buffer.storage_offset()
    inside = [i + start for c, s in zip(changed, optimizer.storages) if s is storage for i in c.tolist()]
    only_the_edit = sum(c.numel() for c in changed) == len(inside) and all(
        offset <= i < offset + edited.numel() for i in inside)
    return before_save, only_the_edit, len(inside)


def test_outside_edits_reach_saved_state_and_resync_only_the_edited_parameter(world_size_2):
    results = case_results(world_size_2, "outside_edits")
    assert all(before_save and only_the_edit for before_save, only_the_edit, _ in results)
    assert sum(count for _, _, count in results) > 0  # the edit did change some master elements


def _zero_grad_keep(rank, world_size):
    """zero_grad(set_to_none=False) with offload: no step without gradients, and no blocking copies after."""
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, offload="cpu",
                                 bucket_numel=4096, lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.zero_grad(set_to_none=False)
    optimizer.step()
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    optimizer.backward(model(**batch(rank, 0, 0)).loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    waits = []
    original = optimizer.gradients.wait_copies
    optimizer.gradients.wait_copies = lambda: waits.append(1) or original()
    optimizer.backward(model(**batch(rank, 1, 0)).loss)
    return unchanged, len(waits), len(optimizer.layout.buckets)


def test_zero_grad_without_none_neither_steps_nor_blocks(world_size_2):
    for unchanged, waits, buckets in case_results(world_size_2, "zero_grad_keep"):
        assert unchanged and waits == 0 and buckets > 2


def _world_size_2(rank, world_size):
    # the host-sync counts first, while the processes are fresh (nothing can have been initialised already)
    cases = {("host_syncs", dtype): partial(_host_syncs_few_and_many_buckets, rank, world_size, dtype)
             for dtype in HOST_SYNC_DTYPES}
    for dtype in (torch.float32, torch.bfloat16):
        cases[("parity", dtype)] = partial(_parity_runs, rank, world_size, (dtype,))
    cases.update({"hint_memory": partial(_hint_memory, rank, world_size),
                  "host_arena": partial(_host_arena, rank, world_size),
                  "mixed_dtypes": partial(_mixed_dtypes, rank, world_size),
                  "pipeline": partial(_pipeline_order, rank, world_size)})
    for case in EDITED_CASES:
        cases[("edited", *case)] = partial(_edited_params, rank, world_size, *case)
    for name in OTHER_OPTIMIZERS:
        cases[("other_optimizers", name)] = partial(_any_optimizer, rank, world_size, name)
    cases["outside_edits"] = partial(_edits_before_save_and_per_parameter, rank, world_size)
    cases["zero_grad_keep"] = partial(_zero_grad_keep, rank, world_size)
    return run_cases(cases)


# -- in process --------------------------------------------------------------------------------------------------
def test_resolve_offload():
    """Catches: "cpu" giving no policy (offload silently off) or a policy replaced by the default one."""
    policy = CPUOffload(pin_memory=False, fused_step=False)
    assert resolve_offload(None) is None and resolve_offload(policy) is policy
    assert resolve_offload("cpu") == CPUOffload() and CPUOffload().fused_step and CPUOffload().pin_memory


@pytest.mark.parametrize("optimizer_class", FUSED_CPU_OPTIMIZERS, ids=lambda c: c.__name__)
def test_the_fused_host_step_is_chosen_only_where_torch_has_it_and_the_user_chose_no_kernel(optimizer_class):
    """The kwargs chosen build an optimizer that steps on the CPU (torch really has a fused CPU kernel for
    the class); a kernel or mode chosen by the user, in the kwargs or in any group, or fused_step=False,
    keeps the user's kwargs. Catches: a class without a fused CPU kernel listed (its step would raise), the
    user's foreach/capturable overridden, or their dict mutated."""
    kwargs = {"lr": 0.1}
    chosen = host_optimizer_kwargs(optimizer_class, kwargs, set(), CPUOffload())
    assert chosen == {"lr": 0.1, "fused": True} and kwargs == {"lr": 0.1}
    param = torch.zeros(4, requires_grad=True)
    param.grad = torch.ones(4)
    optimizer_class([param], **chosen).step()
    assert param.detach().abs().sum() > 0
    for key in ("fused", "foreach", "capturable", "differentiable"):
        assert host_optimizer_kwargs(optimizer_class, {"lr": 0.1, key: False}, set(), CPUOffload()) == {
            "lr": 0.1, key: False}
        assert host_optimizer_kwargs(optimizer_class, kwargs, {key}, CPUOffload()) == kwargs
    assert host_optimizer_kwargs(optimizer_class, kwargs, set(), CPUOffload(fused_step=False)) == kwargs


def test_no_fused_kernel_is_asked_of_a_class_without_one():
    """RMSprop has no fused kernel: asking for one raises in torch, so its kwargs stay as given."""
    with pytest.raises(TypeError):
        torch.optim.RMSprop([torch.zeros(1, requires_grad=True)], fused=True)
    assert host_optimizer_kwargs(torch.optim.RMSprop, {"lr": 0.1}, set(), CPUOffload()) == {"lr": 0.1}


# Each parameter in its own bucket (bucket_numel=1), world size 2, alignment 8: a bucket of n elements is
# padded to a multiple of 16 and each rank's shard is half of that.
MIXED = [(torch.float32, 100), (torch.bfloat16, 30), (torch.bfloat16, 70), (torch.float16, 10),
         (torch.float64, 5), (torch.bfloat16, 17)]


def _shard(numel, world_size=2, alignment=8):
    return -(-numel // (world_size * alignment)) * (world_size * alignment) // world_size


def _mixed_layout():
    specs = [ParamSpec(0, str(dtype), numel) for dtype, numel in MIXED]
    return build_layout(specs, world_size=2, bucket_numel=1, alignment=8), [dtype for dtype, _ in MIXED]


def test_staging_sizes_are_the_largest_shard_of_each_16bit_dtype():
    """Catches: the bucket's numel or padded size taken for its shard; the last bucket's shard instead of the
    largest; fp32 or fp64 buckets given staging buffers (their masters need no conversion)."""
    layout, dtypes = _mixed_layout()
    assert staging_sizes(layout, dtypes) == {torch.bfloat16: _shard(70), torch.float16: _shard(10)}


def test_host_buffers_give_each_bucket_its_own_master_and_gradient_and_two_staging_buffers_per_16bit_dtype():
    """Per bucket a master and a gradient shard of its shard size in fp32 (fp64 for fp64 parameters), per
    16-bit dtype two staging buffers of that dtype, all disjoint, in one arena of exactly their bytes.
    Catches: the master and the gradient shard of a bucket sharing memory (the step would read its own
    output), a bf16 master (ZeRO-Offload keeps fp32 on the host), a staging buffer missing."""
    layout, dtypes = _mixed_layout()
    arena, masters, grads, staging = host_buffers(layout, dtypes, pin_device=None)
    by_bucket = [(MIXED[b.param_indices[0]], b) for b in layout.buckets]
    for (dtype, numel), master, grad in zip((m for m, _ in by_bucket), masters, grads):
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        assert master.dtype == grad.dtype == wide and master.numel() == grad.numel() == _shard(numel)
    assert sorted(staging, key=str) == [torch.bfloat16, torch.float16]
    assert [(t.dtype, t.numel()) for t in staging[torch.bfloat16]] == [(torch.bfloat16, _shard(70))] * 2
    assert [(t.dtype, t.numel()) for t in staging[torch.float16]] == [(torch.float16, _shard(10))] * 2
    tensors = masters + grads + staging[torch.bfloat16] + staging[torch.float16]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    masters_and_grads = sum(2 * _shard(n) * (8 if d == torch.float64 else 4) for d, n in MIXED)
    expected = masters_and_grads + 2 * 2 * (_shard(70) + _shard(10))  # two 2-byte staging buffers per dtype
    assert expected == sum(t.numel() * t.element_size() for t in tensors)
    assert expected <= arena.nbytes < expected + mmap.PAGESIZE
