"""Host memory (zeroimpl.host_memory), in process: the page-aligned arena and its slices, whole-page mappings kept
from forked children, and device_tensor's dtype."""

import gc
import mmap

import pytest
import torch

from zeroimpl.host_memory import HostArena, device_tensor, to_device, whole_pages

CPU = torch.device("cpu")


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