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
