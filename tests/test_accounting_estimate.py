"""zeroimpl.estimate_memory against what a ShardedOptimizer really holds (memory_report) on 2 ranks.

The estimate from the model's parameters for this rank must be exact (same layout, optimizer state probed from the
class); the estimate from a bare parameter count may differ only by padding (< 1 bucket of
world_size * alignment elements per bucket, here < 0.5%).
"""

from functools import partial

import pytest
import torch

from distributed import case_results, run_cases, run_distributed
from workloads import batch, build_model, matrix_param_groups, param_groups
from zeroimpl import ShardedOptimizer, estimate_memory

OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-3}),
              "sgd-momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
              "adagrad": (torch.optim.Adagrad, {"lr": 1e-2})}
CONFIGS = [("adamw", 1, torch.float32, None), ("adamw", 2, torch.float32, None),
           ("adamw", 1, torch.bfloat16, None), ("adamw", 2, torch.bfloat16, None),
           ("adamw", 1, torch.float32, "cpu"), ("adamw", 2, torch.bfloat16, "cpu"),
           ("sgd-momentum", 2, torch.float32, None), ("adagrad", 1, torch.bfloat16, "cpu"),
           ("adamw+muon", 2, torch.float32, None), ("adamw+muon", 1, torch.bfloat16, "cpu"),
           ("adamw+adafactor", 2, torch.float32, None), ("adamw+adafactor", 2, torch.float32, "cpu")]


def _measured_and_estimated(rank, world_size, name, stage, dtype, offload):
    optimizer_class, kwargs = OPTIMIZERS[name.split("+")[0]]
    model = build_model("llama", dtype)
    groups = param_groups(model) if "+" not in name else matrix_param_groups(model, name.split("+")[1])
    settings = dict(dtype=dtype, offload=offload, optimizer_class=optimizer_class, optimizer_kwargs=kwargs,
                    bucket_numel=4096)
    from_model = estimate_memory(groups, world_size, stage, rank=rank, **settings)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    from_count = estimate_memory(numel, world_size, stage, **settings)
    optimizer = ShardedOptimizer(groups, optimizer_class, stage=stage, offload=offload, bucket_numel=4096, **kwargs)
    for step in range(2):  # the second backward is the steady state: optimizer state exists
        optimizer.zero_grad()
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        measured = optimizer.memory_report()
        optimizer.step()
    return measured, from_model, from_count


def _every_config(rank, world_size):
    return run_cases({config: partial(_measured_and_estimated, rank, world_size, *config) for config in CONFIGS})


@pytest.fixture(scope="module")
def reports():
    return run_distributed(2, _every_config)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_estimate_from_the_model_is_exact(reports, config):
    for measured, from_model, _ in case_results(reports, config):
        assert from_model.as_dict() == measured.as_dict()


@pytest.mark.parametrize("config", [c for c in CONFIGS if "+" not in c[0]], ids=lambda c: "-".join(map(str, c)))
def test_estimate_from_a_count_is_within_padding(reports, config):
    """(A count says nothing of which parameters another class steps: flat, single-class configurations.)"""
    for measured, _, from_count in case_results(reports, config):
        assert from_count.total > 0
        assert abs(from_count.total - measured.total) <= 0.005 * measured.total


def test_capturable_is_estimated_as_the_same_state_and_refused_with_offload():
    """torch's capturable=True (CUDA graphs) keeps the same state tensors, on the GPU: the estimate, probed on
    the host, must not trip on it; with offload the host step cannot run it, so it is refused as the optimizer
    refuses it."""
    plain = estimate_memory(10_000, 2, optimizer_class=torch.optim.AdamW)
    capturable = estimate_memory(10_000, 2, optimizer_class=torch.optim.AdamW, optimizer_kwargs={"capturable": True})
    assert capturable.device.optimizer_state == plain.device.optimizer_state > 0
    with pytest.raises(ValueError, match="capturable=True .* drop capturable=True"):
        estimate_memory(10_000, 2, offload="cpu", optimizer_kwargs={"capturable": True})


def test_estimate_refuses_bad_input():
    with pytest.raises(ValueError, match="stage"):
        estimate_memory(1000, 2, stage=3)
    with pytest.raises(ValueError, match="positive"):
        estimate_memory(0, 2)
    with pytest.raises(ValueError, match="offload"):
        estimate_memory(1000, 2, offload="gpu")
    with pytest.raises(ValueError, match="Muon is sharded by whole parameters.*not a count"):
        estimate_memory(1000, 2, optimizer_class=torch.optim.Muon)


# -- in process --------------------------------------------------------------------------------------------------
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
