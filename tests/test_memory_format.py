"""Parameters keep their memory format through flattening: channels_last conv weights (the strides cuDNN's
NHWC kernels need) and a transposed matrix. Training is bitwise that of DDP + the same torch optimizer on
the same channels_last model at world size 2 (stages 1 and 2, offload, AdamW and whole-parameter
Adafactor), and checkpoints export the parameters and the torch optimizer state in the model's shapes,
strides and values.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from distributed import run_distributed
from zeroimpl import CPUOffload, ShardedOptimizer
from zeroimpl.checkpoint import (CheckpointError, consolidated_optimizer_state_dict, export_fp32_state_dict,
                                 load_checkpoint, load_torch_optimizer_state, save_checkpoint)
from zeroimpl.memory_format import contiguous_strides, dense_strides, flattened, same_order, shaped


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Parameter(torch.randn(4, 8).t() * 0.3)  # (8, 4), strides (1, 8)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return x.mean(dim=(2, 3)) @ self.head


def _model(channels_last=True):
    torch.manual_seed(0)
    model = ConvNet()
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _data(rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)
    images = torch.randn(4, 3, 8, 8, generator=generator).to(memory_format=torch.channels_last)
    return images, torch.randint(0, 4, (4,), generator=generator)


OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
              "adafactor": (torch.optim.Adafactor, {"lr": 1e-2})}
CASES = {"stage 1": ("adamw", {"stage": 1}), "stage 2": ("adamw", {"stage": 2}),
         "stage 2 + offload": ("adamw", {"stage": 2, "offload": CPUOffload(fused_step=False)}),
         "adafactor, stage 2": ("adafactor", {"stage": 2})}


def _train(rank, optimizer_name, zero_kwargs, root=None):
    model = _model()
    strides = {name: p.stride() for name, p in model.named_parameters()}
    optimizer_class, kwargs = OPTIMIZERS[optimizer_name]
    if zero_kwargs is None:
        forward, optimizer = DistributedDataParallel(model), optimizer_class(model.parameters(), **kwargs)
    else:
        forward = model
        optimizer = ShardedOptimizer(model.parameters(), optimizer_class, bucket_numel=256, **zero_kwargs, **kwargs)
    kept = {name: p.stride() for name, p in model.named_parameters()} == strides
    for step in range(4):
        _step(forward, optimizer, rank, step)
    result = {"params": {name: p.detach().clone() for name, p in model.named_parameters()}, "kept": kept}
    if zero_kwargs is None:
        result["state"] = optimizer.state_dict()["state"]
    elif root is not None:
        save_checkpoint(root, optimizer, model)
    return result


def _step(forward, optimizer, rank, step):
    images, labels = _data(rank, step)
    F.cross_entropy(forward(images), labels).backward()
    optimizer.step()
    optimizer.zero_grad()


def _resumed_from_torch(rank, optimizer_name, zero_kwargs):
    """DDP trains 3 steps; its weights and torch optimizer state move into a ShardedOptimizer
    (load_torch_optimizer_state); then both take 2 more steps: the models must be equal bitwise."""
    optimizer_class, kwargs = OPTIMIZERS[optimizer_name]
    model = _model()
    ddp, optimizer = DistributedDataParallel(model), optimizer_class(model.parameters(), **kwargs)
    for step in range(3):
        _step(ddp, optimizer, rank, step)
    ours = _model()
    ours.load_state_dict(model.state_dict())
    sharded = ShardedOptimizer(ours.parameters(), optimizer_class, bucket_numel=256, **zero_kwargs, **kwargs)
    load_torch_optimizer_state(sharded, optimizer.state_dict())
    for step in range(3, 5):
        _step(ddp, optimizer, rank, step)
        _step(ours, sharded, rank, step)
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), ours.parameters()))


def _ranks_disagree(rank):
    """Rank 0 channels_last, rank 1 contiguous: the same values, other flat orders; refused at construction."""
    model = _model(channels_last=rank == 0)
    try:
        ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, bucket_numel=256, lr=1e-2)
    except RuntimeError as error:
        return str(error)
    return None


def _state_dict_across_formats(rank):
    """optimizer.state_dict() of the channels_last model loaded into a contiguous one, and one without
    recorded strides (an older zeroimpl's: contiguous order) into the channels_last model: both refused."""
    model = _model()
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, bucket_numel=256, lr=1e-2)
    _step(model, optimizer, rank, 0)
    state = optimizer.state_dict()
    refused = []
    for channels_last, saved in ((False, state), (True, {k: v for k, v in state.items() if k != "strides"})):
        other = _model(channels_last)
        target = ShardedOptimizer(other.parameters(), torch.optim.AdamW, stage=2, bucket_numel=256, lr=1e-2)
        try:
            target.load_state_dict(saved)
            refused.append(None)
        except ValueError as error:
            refused.append(str(error))
    return refused


def _runs(rank, world_size, root):
    results = {}
    for name, (optimizer_name, zero_kwargs) in CASES.items():
        results[name] = _train(rank, optimizer_name, zero_kwargs, os.path.join(root, name))
        results[name, "DDP"] = _train(rank, optimizer_name, None)
        results[name, "resumed"] = _resumed_from_torch(rank, optimizer_name, zero_kwargs)
    results["ranks disagree"] = _ranks_disagree(rank)
    results["state_dict"] = _state_dict_across_formats(rank)
    # a checkpoint of the channels_last model loaded into a contiguous one: refused on every rank
    model = _model(channels_last=False)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, bucket_numel=256, lr=1e-2)
    try:
        load_checkpoint(os.path.join(root, "stage 2"), optimizer, model)
        results["refused"] = None
    except CheckpointError as error:
        results["refused"] = str(error)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("memory_format"))
    return root, run_distributed(2, _runs, root)


@pytest.mark.parametrize("case", sorted(CASES))
def test_memory_format_is_kept_and_training_is_bitwise_ddp(runs, case):
    _, by_rank = runs
    for results in by_rank:
        ours, reference = results[case], results[case, "DDP"]
        assert ours["kept"] and reference["kept"]
        for name, p in ours["params"].items():
            assert torch.equal(p, reference["params"][name]), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_exports_the_models_layout_and_torchs_state(runs, case):
    root, by_rank = runs
    reference = by_rank[0][case, "DDP"]
    exported = export_fp32_state_dict(os.path.join(root, case))
    for name, p in by_rank[0][case]["params"].items():
        assert torch.equal(exported[name], p) and exported[name].stride() == p.stride(), name
    state = consolidated_optimizer_state_dict(os.path.join(root, case))["state"]
    assert state.keys() == reference["state"].keys()
    for number, saved in state.items():
        for key, value in saved.items():
            assert torch.equal(value, reference["state"][number][key]), (number, key)


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_optimizer_state_loads_in_the_models_layout(runs, case):
    for results in runs[1]:
        assert results[case, "resumed"]


def test_a_checkpoint_in_another_memory_format_is_refused(runs):
    _, by_rank = runs
    for results in by_rank:
        assert results["refused"] is not None and "memory format" in results["refused"]


def test_ranks_that_disagree_on_memory_format_are_refused(runs):
    for results in runs[1]:
        assert results["ranks disagree"] is not None and "memory formats" in results["ranks disagree"]


def test_state_dict_in_another_memory_format_is_refused(runs):
    for results in runs[1]:
        assert all(message is not None and "memory format" in message for message in results["state_dict"])


# -- in process --------------------------------------------------------------------------------------------------
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
