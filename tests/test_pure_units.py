"""In-process unit tests of pure parts that the launched tests reach only through a whole optimizer: memory
formats, optimizer kinds, the host arena, offload's host buffers and policy, and ``estimate_memory``'s
figures against the ZeRO formulas. No process group; the file runs in a few seconds.

Expected values come from an independent source each time: torch itself (a tensor's own strides, its
optimizers' behaviour and state), or arithmetic written out here from the documented rules (padding to a
multiple of ``world_size * alignment``, buckets filled in reverse parameter order) and the per-parameter
bytes of the ZeRO paper (arXiv 1910.02054; docs/design.md's table), never a figure read from the code's output.
"""

import gc
import math
import mmap

import pytest
import torch

from zeroimpl import CPUOffload, estimate_memory
from zeroimpl.host_memory import HostArena, device_tensor, to_device, whole_pages
from zeroimpl.layout import ParamSpec, build_layout
from zeroimpl.memory_format import contiguous_strides, dense_strides, flattened, same_order, shaped
from zeroimpl.offload import FUSED_CPU_OPTIMIZERS, host_buffers, host_optimizer_kwargs, resolve_offload, staging_sizes
from zeroimpl.optimizer_kinds import (ELEMENTWISE_OPTIMIZERS, WHOLE_PARAMETER_OPTIMIZERS, groups_with_classes,
                                      sharding_of, step_work)

CPU = torch.device("cpu")


# -- memory formats ------------------------------------------------------------------------------------
def _offsets(shape, strides) -> list[int]:
    """The memory offset of every element of a tensor of ``shape`` and ``strides`` (brute force)."""
    total = torch.zeros(shape, dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(shape, strides)):
        index = torch.arange(size, dtype=torch.int64) * stride
        total = total + index.reshape([size if d == dim else 1 for d in range(len(shape))])
    return sorted(total.reshape(-1).tolist())


def _tensors() -> dict:
    base = torch.arange(2 * 6 * 4 * 4, dtype=torch.float32).reshape(2, 6, 4, 4)
    return {"contiguous": base, "channels_last": base.to(memory_format=torch.channels_last),
            "channels_last_3d": torch.zeros(2, 3, 2, 2, 2).to(memory_format=torch.channels_last_3d),
            "transposed": torch.zeros(5, 3).t(), "permuted": torch.zeros(2, 3, 4).permute(2, 0, 1),
            "size-1 dims": torch.zeros(3, 4).t().unsqueeze(1), "scalar": torch.tensor(1.0), "1-d": torch.zeros(7),
            "empty": torch.zeros(0, 3), "every other column": torch.zeros(3, 8)[:, ::2],
            "narrowed rows": torch.zeros(4, 6)[:, :3], "expanded": torch.zeros(3, 1).expand(3, 4)}


@pytest.mark.parametrize("shape", [(2, 3, 4), (5,), (), (2, 0, 3), (1, 7, 1)])
def test_contiguous_strides_are_torchs(shape):
    """Catches: strides built in the wrong order, or a zero-size dim zeroing the strides before it."""
    assert contiguous_strides(shape) == torch.empty(shape).stride()


@pytest.mark.parametrize("name", sorted(_tensors()))
def test_dense_strides_address_each_of_numel_slots_once_and_keep_a_dense_tensors_order(name):
    """Whatever the tensor, the strides chosen lay its elements on slots 0..numel-1, each once (else the
    flat buffer would overlap or leave holes); a tensor that is dense already keeps its own order (else a
    channels_last weight would lose cuDNN's NHWC kernels). Catches: a gapped slice or an expanded tensor
    taken as dense, a transposed or channels_last tensor stored contiguous."""
    tensor = _tensors()[name]
    strides = dense_strides(tensor)
    assert _offsets(tensor.shape, strides) == list(range(tensor.numel()))
    if _offsets(tensor.shape, tensor.stride()) == list(range(tensor.numel())):
        assert same_order(tensor.shape, strides, tensor.stride())
    else:
        assert strides == contiguous_strides(tensor.shape)


def test_same_order_ignores_dims_of_size_1_only():
    """Catches: strides of size-1 dims (meaningless, torch leaves them arbitrary) compared, refusing an
    identical layout; or a real dim ignored."""
    assert same_order((4, 1, 3), (3, 3, 1), (3, 1, 1))
    assert same_order((4, 1, 3), (3, 100, 1), (3, 1, 1))
    assert not same_order((4, 1, 3), (1, 3, 4), (3, 3, 1))


@pytest.mark.parametrize("name", ["channels_last", "channels_last_3d", "transposed", "permuted"])
def test_flattened_is_memory_order_and_shaped_inverts_it(name):
    """A non-contiguous dense tensor flattens in its memory order (what its optimizer state and checkpoint
    files use), and shaped() gives back the same values with the same strides. Catches: flattening in
    logical order (reshape(-1)), which would pair each element with another element's state."""
    tensor = _tensors()[name].clone().copy_(torch.randn(_tensors()[name].shape))
    strides = dense_strides(tensor)
    flat = flattened(tensor, strides)
    assert torch.equal(flat, tensor.as_strided((tensor.numel(),), (1,)))  # the storage, in memory order
    back = shaped(flat, tensor.shape, strides)
    assert torch.equal(back, tensor) and back.stride() == tensor.stride()


def test_flattened_copies_a_contiguous_tensor_into_another_order_and_views_the_same_order():
    """A contiguous tensor (a freshly loaded checkpoint entry) bound for a channels_last parameter is
    reordered; a contiguous one for a contiguous parameter is a view, not a copy. Catches: returning
    reshape(-1) for every contiguous tensor (elements scrambled), or copying when no reorder is needed."""
    tensor = torch.randn(2, 3, 4, 4)
    channels_last = tensor.contiguous(memory_format=torch.channels_last)
    reordered = flattened(tensor, channels_last.stride())
    assert torch.equal(reordered, channels_last.as_strided((tensor.numel(),), (1,)))
    same = flattened(tensor, tensor.stride())
    assert same.data_ptr() == tensor.data_ptr() and torch.equal(same, tensor.reshape(-1))


# -- optimizer kinds -------------------------------------------------------------------------------------
def _stepped(optimizer_class, tensors, grads, kwargs) -> list[torch.Tensor]:
    """``tensors`` (leaf copies) after one step per gradient list of ``grads``."""
    params = [t.clone().requires_grad_(True) for t in tensors]
    optimizer = optimizer_class(params, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("optimizer_class", sorted(ELEMENTWISE_OPTIMIZERS, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_classes_sharded_flat_step_a_tensor_cut_anywhere_as_the_whole(optimizer_class):
    """Flat sharding cuts parameters at arbitrary element boundaries; that is exact only if torch's class
    updates each element from its own parameter, gradient and state. Three steps of the class on a tensor
    and on the same tensor cut in two pieces agree (fp64, to rounding). Catches: a class that needs whole
    tensors (a norm, factored state) listed as elementwise."""
    torch.manual_seed(0)
    whole = torch.randn(24, dtype=torch.float64)
    grads = [torch.randn(24, dtype=torch.float64) * (1 + step) for step in range(3)]
    kwargs = {"momentum": 0.9} if optimizer_class is torch.optim.SGD else {}
    assert sharding_of(optimizer_class, (), False) == "flat"
    (expected,) = _stepped(optimizer_class, [whole], [[g] for g in grads], kwargs)
    pieces = _stepped(optimizer_class, [whole[:10], whole[10:]], [[g[:10], g[10:]] for g in grads], kwargs)
    torch.testing.assert_close(torch.cat(pieces), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("optimizer_class", sorted(WHOLE_PARAMETER_OPTIMIZERS, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_classes_sharded_by_whole_parameters_really_need_them(optimizer_class):
    """Muon (Newton-Schulz on the matrix) and Adafactor (row and column second moments) step a matrix cut in
    two differently from the whole matrix: flat sharding would change their math. Catches: one of them
    moved to the flat kinds."""
    torch.manual_seed(0)
    whole = torch.randn(4, 6)
    grads = [torch.randn(4, 6) * torch.arange(1, 5).reshape(4, 1) for _ in range(2)]
    assert sharding_of(optimizer_class, (), True) == "whole"  # even where unknown classes are assumed flat
    (expected,) = _stepped(optimizer_class, [whole], [[g] for g in grads], {})
    pieces = _stepped(optimizer_class, [whole[:2], whole[2:]], [[g[:2], g[2:]] for g in grads], {})
    assert (torch.cat(pieces) - expected).abs().max() > 1e-4


def test_sharding_precedence_refused_then_marked_whole_then_known_then_assumed():
    """Catches: per_parameter ignored for a known elementwise class (a user's reason to step AdamW whole);
    a refused class let through because the user marked it; an unknown class assumed flat without the flag."""
    class Unknown(torch.optim.Optimizer):
        pass

    assert sharding_of(torch.optim.AdamW, [torch.optim.AdamW], False) == "whole"
    assert sharding_of(torch.optim.AdamW, [torch.optim.SGD], False) == "flat"
    assert sharding_of(Unknown, [Unknown], False) == "whole"
    assert sharding_of(Unknown, (), True) == "flat"
    with pytest.raises(ValueError, match="cannot tell how to shard Unknown"):
        sharding_of(Unknown, (), False)
    for refused in (torch.optim.LBFGS, torch.optim.SparseAdam):
        with pytest.raises(ValueError, match="cannot be sharded"):
            sharding_of(refused, [refused], True)


@pytest.mark.parametrize("shape", [(4, 6), (6, 4), (3, 4, 5), (7,)])
def test_step_work_is_newton_schulz_for_muon_and_elements_otherwise(shape):
    """Muon's Newton-Schulz costs m·n·min(m, n) per matrix (its iterations multiply by the smaller side;
    ZERO_NOTES), on the last two dims; any other class costs its elements. Catches: max instead of min, or
    the element count for Muon, which would balance the ranks' step time wrongly."""
    m, n = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[0])
    assert step_work(torch.optim.Muon)(shape) == math.prod(shape[:-2]) * m * n * min(m, n)
    assert step_work(torch.optim.AdamW)(shape) == math.prod(shape)


def test_groups_with_classes_fills_defaults_without_overriding_or_mutating():
    """Catches: the optimizer's keyword arguments overriding a group's own value (a group's lr lost), being
    given to a group of another class (AdamW's betas passed to Muon), or the user's dicts being edited."""
    a, b, c = (torch.zeros(2, 2, requires_grad=True) for _ in range(3))
    user = [{"params": [a], "lr": 0.5}, {"params": [b]}, {"params": [c], "optimizer": torch.optim.Muon}]
    groups = groups_with_classes(user, torch.optim.AdamW, {"lr": 1e-3, "betas": (0.8, 0.9)})
    assert groups[0] == {"params": [a], "lr": 0.5, "betas": (0.8, 0.9), "optimizer": torch.optim.AdamW}
    assert groups[1] == {"params": [b], "lr": 1e-3, "betas": (0.8, 0.9), "optimizer": torch.optim.AdamW}
    assert groups[2] == {"params": [c], "optimizer": torch.optim.Muon}
    assert user[0] == {"params": [a], "lr": 0.5} and user[1] == {"params": [b]}
    plain = groups_with_classes(iter([a, b]), torch.optim.SGD, {"lr": 0.1})  # a generator, read once
    assert plain == [{"params": [a, b], "optimizer": torch.optim.SGD, "lr": 0.1}]


# -- host memory -----------------------------------------------------------------------------------------
SIZES = [(3, torch.bfloat16), (5, torch.float32), (0, torch.float32), (7, torch.float16), (2, torch.float64),
         (1, torch.bfloat16)]


def test_host_arena_is_its_slices_up_to_a_page_each_aligned_and_zeroed():
    """One mapping of the slices' bytes rounded up to whole pages (no power-of-two rounding), every slice of
    its size and dtype, aligned to its element size, inside the arena, and zero. Catches: slices laid out in
    the order given (a float32 after 3 bf16 elements sits at byte 6: misaligned), rounding beyond a page,
    uninitialised memory (a host gradient shard's padding must read zero)."""
    arena = HostArena(SIZES, pin_device=None)
    exact = sum(numel * dtype.itemsize for numel, dtype in SIZES)
    assert exact <= arena.nbytes < exact + mmap.PAGESIZE and arena.start % mmap.PAGESIZE == 0
    assert not arena.pinned and not arena.registered
    for piece, (numel, dtype) in zip(arena.slices, SIZES):
        assert piece.dtype == dtype and piece.numel() == numel and piece.dim() == 1 and not piece.any()
        if numel:  # (an empty tensor has no address)
            start = piece.data_ptr() - arena.start
            assert start % dtype.itemsize == 0 and 0 <= start and start + numel * dtype.itemsize <= arena.nbytes


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_whole_pages_are_a_mapping_of_their_own(nbytes):
    """What a pinned arena registers with cudaHostRegister. Catches: a range that starts inside a page or ends
    inside one (two arenas could then share a page, which the second registration fails on), or that is
    shorter than asked, or not zero; a shared mapping (a forked child, as a DataLoader worker, would write
    into the parent's masters)."""
    page = mmap.PAGESIZE
    pages = whole_pages(nbytes)
    block = torch.frombuffer(pages, dtype=torch.uint8)
    assert block.data_ptr() % page == 0 and len(pages) % page == 0 and nbytes <= len(pages) < max(nbytes, 1) + page
    assert not block.any()
    assert _mapping(block.data_ptr())[0] == "rw-p"


def test_whole_pages_to_be_pinned_are_not_inherited_by_a_forked_child():
    """A pinned arena's mapping is left out of forked children (as RDMA libraries do for registered memory):
    after a fork, the parent's first write to a private page would copy it away from the page the device's
    copies use, unless the kernel and driver pin in the way that copies at fork. Catches: the advice missing
    (the kernel's "dc" flag of the mapping), or given to arenas that are not pinned."""
    def flags(pages: mmap.mmap) -> list[str]:
        return _mapping(torch.frombuffer(pages, dtype=torch.uint8).data_ptr())[1]
    assert "dc" in flags(whole_pages(3 * mmap.PAGESIZE, inherited=False))
    assert "dc" not in flags(whole_pages(3 * mmap.PAGESIZE))
    unpinned = HostArena([(3 * mmap.PAGESIZE, torch.uint8)], pin_device=None)
    assert "dc" not in _mapping(unpinned.start)[1]


def _mapping(address: int) -> tuple[str, list[str]]:
    """The permissions and the kernel's flags of the mapping that holds ``address`` (/proc/self/smaps; the
    kernel merges neighbouring mappings of the same flags, so it may start below), or ("", []) when none does."""
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for index, line in enumerate(lines):
        bounds = line.split()[0].split("-")
        if len(bounds) == 2 and int(bounds[0], 16) <= address < int(bounds[1], 16):
            return line.split()[1], next(rest.split()[1:] for rest in lines[index + 1:] if rest.startswith("VmFlags:"))
    return "", []


def test_each_slice_is_a_storage_of_its_own_that_keeps_the_arena_mapped(tmp_path):
    """Catches: slices that share one storage (``torch.save`` of one slice, as of a state_dict's master
    weights, writes the whole arena: masters, gradient shards and staging; ``Tensor.is_pinned`` asks about
    the storage's first byte, which then lies outside the slice); a mapping unmapped under a live slice when
    the arena is gone (a crash or garbage)."""
    arena = HostArena([(1 << 16, torch.float32), (1 << 16, torch.float32), (16, torch.bfloat16)], pin_device=None)
    for piece in arena.slices:
        assert piece.untyped_storage().data_ptr() == piece.data_ptr()
        assert piece.untyped_storage().nbytes() == piece.numel() * piece.element_size()
    torch.save(arena.slices[2], tmp_path / "slice.pt")
    assert (tmp_path / "slice.pt").stat().st_size < 2048
    last, start = arena.slices[-1], arena.start
    del arena
    gc.collect()
    last.fill_(3.0)
    assert _mapping(start)[0] == "rw-p" and last.sum().item() == 48.0


def test_host_arena_slices_do_not_overlap():
    """Each slice keeps what is written to it when all the others are written. Catches: two slices given the
    same or overlapping offsets (a master and a gradient shard sharing bytes)."""
    arena = HostArena(SIZES, pin_device=None)
    for index, piece in enumerate(arena.slices):
        piece.fill_(index + 1)
    for index, piece in enumerate(arena.slices):
        assert bool((piece == index + 1).all())


def test_device_tensor_keeps_the_dtype_from_the_values():
    """Catches: the values made a tensor in the default dtype first and converted after (0.1 would become
    float32's 0.1 in a float64 tensor; a large integer would round)."""
    assert device_tensor([0.1], CPU, torch.float64).item() == 0.1
    assert device_tensor([2 ** 53 - 1], CPU, torch.int64).item() == 2 ** 53 - 1
    values = torch.arange(4, dtype=torch.bfloat16)
    moved = to_device(values, CPU)
    assert moved.dtype == torch.bfloat16 and moved.device == CPU and torch.equal(moved, values)


# -- offload: policy, host step kwargs, host buffers ---------------------------------------------------
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


# -- estimate_memory against the ZeRO formulas -------------------------------------------------------------
# A bare count of Ψ = 4 buckets of 4096 elements: no padding at N = 1, 2, 4 (4096 is a multiple of N·8), and
# each rank holds one piece of each bucket, so Adam keeps 8 bytes per owned element (exp_avg, exp_avg_sq in
# fp32) plus its fp32 `step` per piece: 4 bytes × 4 buckets.
BUCKET, BUCKETS = 4096, 4
PSI = BUCKET * BUCKETS
ADAM_STEPS = 4 * BUCKETS


def _zero_bytes(stage, p, n, reduce_bytes=4, offload=False):
    """Model-state bytes per rank by the ZeRO formulas (p: bytes per parameter element, n: ranks, Adam):
    the model's parameters p·Ψ; stage 1 keeps the full gradient p·Ψ until step(); stage 2 the averaged
    gradient shard (reduce dtype) of Ψ/N; an fp32 master of Ψ/N unless the parameters are fp32 (or offload,
    which keeps one on the host); Adam's two fp32 moments 8Ψ/N. With offload the host holds the fp32 master,
    the fp32 gradient shard and the state (16Ψ/N), and for a 16-bit model two staging buffers of the largest
    shard."""
    shard = PSI // n
    device = {"parameters": p * PSI, "gradients": p * PSI if stage == 1 else 0}
    state = 8 * shard + ADAM_STEPS
    if offload:
        host = {"gradient_shard": 4 * shard, "master_weights": 4 * shard, "optimizer_state": state,
                "bucket_buffers": 2 * p * (BUCKET // n) if p == 2 else 0}
        return device, host
    device.update(gradient_shard=reduce_bytes * shard if stage == 2 else 0,
                  master_weights=0 if p == 4 else 4 * shard, optimizer_state=state)
    return device, {}


ESTIMATES = [(stage, dtype, n, reduce_dtype, offload) for n in (1, 2, 4) for stage in (1, 2)
             for dtype, reduce_dtype, offload in [(torch.float32, None, None), (torch.bfloat16, None, None),
                                                  (torch.bfloat16, torch.bfloat16, None), (torch.float32, None, "cpu"),
                                                  (torch.bfloat16, None, "cpu")]]


@pytest.mark.parametrize("stage,dtype,n,reduce_dtype,offload", ESTIMATES)
def test_estimate_from_a_count_is_the_zero_formula(stage, dtype, n, reduce_dtype, offload):
    """Each kind of bytes against the formula (``_zero_bytes``), and the totals against the figures every
    paper quotes: fp32 stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N; 16-bit stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 16Ψ/N
    with an fp32 gradient shard, the paper's 2Ψ + 14Ψ/N with a 16-bit one; offload: 16Ψ/N on the host.
    Catches: the shard not divided by N, a master counted for an fp32 model, stage 1 counted with a shard,
    the reduce dtype ignored, the state tabulated instead of measured per piece."""
    p = torch.finfo(dtype).bits // 8
    report = estimate_memory(PSI, n, stage, dtype=dtype, offload=offload, reduce_dtype=reduce_dtype,
                             bucket_numel=BUCKET, optimizer_kwargs={"lr": 1e-3})
    device, host = _zero_bytes(stage, p, n, 2 if reduce_dtype == torch.bfloat16 else 4, offload == "cpu")
    kinds = ("parameters", "gradients", "gradient_shard", "master_weights", "optimizer_state", "bucket_buffers")
    assert report.device.as_dict() == {**{k: device.get(k, 0) for k in kinds}, "total": sum(device.values())}
    assert report.host.as_dict() == {**{k: host.get(k, 0) for k in kinds}, "total": sum(host.values())}
    per_param = {(1, 4): (8, 8), (2, 4): (4, 12), (1, 2): (4, 12), (2, 2): (2, 16 if reduce_dtype is None else 14)}
    full, sharded = per_param[(stage, p)] if offload is None else (p * (2 if stage == 1 else 1), 16)
    staging = host.get("bucket_buffers", 0)
    assert report.total == full * PSI + sharded * PSI // n + ADAM_STEPS + staging


@pytest.mark.parametrize("momentum, per_element", [(0.0, 0), (0.9, 4)])
def test_estimated_optimizer_state_is_what_the_class_keeps(momentum, per_element):
    """SGD keeps a momentum buffer only with momentum, and no step counter. Catches: Adam's 8 bytes assumed
    for every class."""
    report = estimate_memory(PSI, 2, 2, optimizer_class=torch.optim.SGD,
                             optimizer_kwargs={"lr": 0.1, "momentum": momentum}, bucket_numel=BUCKET)
    assert report.device.optimizer_state == per_element * PSI // 2


def test_estimate_from_a_model_counts_padding_and_pieces_per_rank():
    """nn.Linear(10, 7): Ψ = 77 elements in one bucket, padded to 80 at N = 2 (a multiple of 2·8), so each
    rank owns a shard of 40. The buffers count the padding (4·80 bytes of fp32 parameters, a 4·40 gradient
    shard); stage 1's full gradients are the parameters' own .grad (4·77, no padding); Adam's state has no
    padding: 8 bytes per owned element and a 4-byte step per piece. The bias (7) fits in one shard and the
    weight (70) spans both, so the ranks together own 77 elements in 3 pieces, and the default rank is the
    one holding more. Catches: padding dropped from the buffers or given optimizer state, the ranks' pieces
    miscounted, the smaller rank reported."""
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 7)
    settings = dict(optimizer_kwargs={"lr": 1e-3}, bucket_numel=2 ** 20)
    stage2 = estimate_memory(model.parameters(), 2, 2, **settings)
    assert (stage2.device.parameters, stage2.device.gradient_shard, stage2.device.gradients) == (4 * 80, 4 * 40, 0)
    assert estimate_memory(model.parameters(), 2, 1, **settings).device.gradients == 4 * 77
    by_rank = [estimate_memory(model.parameters(), 2, 2, rank=r, **settings).device.optimizer_state for r in (0, 1)]
    assert sum(by_rank) == 8 * 77 + 4 * 3
    assert stage2.device.optimizer_state == max(by_rank) and by_rank[0] != by_rank[1]


def test_node_count_counts_distinct_node_numbers_and_any_unknown_as_one_node():
    """comm.node_count: the ranks' node numbers (torchrun's GROUP_RANK + 1), 0 where a rank's is unknown."""
    from zeroimpl.comm import node_count

    assert node_count([1, 1, 2, 2]) == 2 and node_count([1, 1, 1]) == 1 and node_count([3, 1, 2]) == 3
    assert node_count([1, 2, 1, 2, 2, 2]) == 2  # nodes with 2 and 4 ranks
    assert node_count([1, 0, 2]) == 1 and node_count([0, 0]) == 1


def test_the_topology_carries_the_parameters_device_for_its_object_all_gathers():
    """Catches: the checkpoint's and construction's agreements gathered on the current GPU (GPU 0 on every rank
    of a script that never calls torch.cuda.set_device) instead of the parameters' (frozen ones do not count)."""
    from zeroimpl.topology import resolve_topology

    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    trainable = torch.nn.Parameter(torch.zeros(2, device="meta"))
    groups = [{"params": [frozen]}, {"params": [trainable]}]
    assert resolve_topology(None, None, groups, None).device == torch.device("meta")


@pytest.mark.parametrize("length", [1, 256, 4096])
def test_a_low_bit_pieces_scales_and_map_are_piece_level_whatever_its_length(length):
    """bitsandbytes' state of a piece of ``length`` elements: ``qmap1`` has 256 entries and ``absmax1`` one per
    block of 256, so a 256-element piece's map (or a 1-element piece's scale) has the piece's shape. Catches:
    either filed as per-element state (resharded element by element, its block structure lost)."""
    from zeroimpl.state_format import split_state

    state = {"step": torch.tensor(1.0), "state1": torch.zeros(length, dtype=torch.uint8),
             "qmap1": torch.linspace(-1, 1, 256), "absmax1": torch.ones(-(-length // 256))}
    elementwise, scalars, piece_level = split_state(state, (length,), whole=True)
    assert set(elementwise) == {"state1"} and set(scalars) == {"step"} and set(piece_level) == {"qmap1", "absmax1"}


class _OtherSubclass(torch.Tensor):
    """A tensor subclass of unknown layout (it declares the flatten protocol, as torchao's states do)."""

    def __tensor_flatten__(self):
        return [], None


def test_optimizer_state_of_an_unknown_tensor_subclass_is_refused_by_name():
    """Checkpoints store torchao's three quantized state classes part by part; any other subclass's layout is
    unknown, so splitting it into per-element and per-block parts would be a guess: refused, naming it."""
    from zeroimpl.checkpoint import CheckpointError
    from zeroimpl.state_format import split_state

    state = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(8).as_subclass(_OtherSubclass)}
    with pytest.raises(CheckpointError, match="'exp_avg' is a _OtherSubclass .*cannot reshard"):
        split_state(state, (8,), whole=True)


def test_a_state_key_that_merely_ends_like_a_stored_part_is_not_taken_for_one():
    """A stored torchao value's recipe is ``key/tensor`` holding (class name, signed, dtype); a user's own state
    under such a key name, of another kind, is checked as any state (a string is neither per element nor a
    scalar: refused at save time, not mistaken for a recipe that fails on load)."""
    from zeroimpl.checkpoint import CheckpointError
    from zeroimpl.state_format import split_state

    with pytest.raises(CheckpointError, match="'foo/tensor'.*neither one value per element nor a scalar"):
        split_state({"step": torch.tensor(1.0), "foo/tensor": "abc"}, (8,), whole=False)
