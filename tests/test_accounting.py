"""memory_report() against the closed-form bytes of ZeRO stage 1 and 2 (arXiv 1910.02054, section 5).

With Ψp = padded trainable elements, N ranks, B buckets, p = bytes per parameter element and AdamW
(two fp32 moments per element plus one fp32 step counter per bucket tensor):

| kind            | stage 1 after backward | stage 2 after backward | both after step       |
| parameters      | p·Ψp                   | p·Ψp                   | p·Ψp                  |
| gradients       | p·Ψ (full .grad)       | 0                      | 0                     |
| gradient_shard  | 0                      | 4·Ψp/N                 | 4·Ψp/N (until zero_grad) |
| master_weights  | 0 for fp32, 4·Ψp/N for 16-bit                                            |
| optimizer_state | 8·Ψp/N + 4·B after the first step                                        |
| bucket_buffers  | 0 outside backward and step                                              |
"""

import pytest
import torch

from distributed import run_distributed
from workloads import batch, build_model, param_groups
from zeroimpl import ShardedOptimizer


def _reports(rank, world_size, stage, dtype):
    model = build_model("gpt2", dtype)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, bucket_numel=4096, lr=1e-3)
    reports = {"init": optimizer.memory_report()}
    for step in range(2):
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        reports[f"backward{step}"] = optimizer.memory_report()
        optimizer.step()
        reports[f"step{step}"] = optimizer.memory_report()
        optimizer.zero_grad()
    layout = optimizer.layout
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return reports, {"padded": layout.padded_numel, "buckets": len(layout.buckets), "psi": psi}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_match_the_formula(stage, dtype):
    world_size = 2
    for reports, sizes in run_distributed(world_size, _reports, stage, dtype):
        p = torch.finfo(dtype).bits // 8
        padded, buckets, psi = sizes["padded"], sizes["buckets"], sizes["psi"]
        shard = padded // world_size
        master = 0 if dtype == torch.float32 else 4 * shard
        expected = {
            "init": dict(parameters=p * padded, gradients=0, gradient_shard=0, master_weights=master,
                         optimizer_state=0, bucket_buffers=0),
            "backward0": dict(parameters=p * padded, gradients=p * psi if stage == 1 else 0,
                              gradient_shard=0 if stage == 1 else 4 * shard, master_weights=master,
                              optimizer_state=0, bucket_buffers=0),
            "step0": dict(parameters=p * padded, gradients=0, gradient_shard=4 * shard, master_weights=master,
                          optimizer_state=8 * shard + 4 * buckets, bucket_buffers=0),
        }
        expected["backward1"] = {**expected["backward0"], "optimizer_state": 8 * shard + 4 * buckets}
        expected["step1"] = expected["step0"]
        for moment, values in expected.items():
            assert reports[moment].as_dict() == {**values, "total": sum(values.values())}, moment


def _peak_bucket_buffers(rank, world_size, max_inflight):
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=2048,
                                 max_inflight_buckets=max_inflight, lr=1e-3)
    peak = [0]

    def observe(_param):  # runs after zeroimpl's own hook on the same parameter
        peak[0] = max(peak[0], optimizer.memory_report().bucket_buffers)

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(observe)
    optimizer.backward(model(**batch(rank, 0, 0)).loss)
    after = optimizer.memory_report()
    largest = max(b.padded_numel for b in optimizer.layout.buckets) * 4
    return peak[0], largest, len(optimizer.layout.buckets), after.bucket_buffers, after.gradients


@pytest.mark.parametrize("max_inflight", [0, 2])
def test_stage2_bucket_buffers_are_bounded_and_freed(max_inflight):
    """During backward at most max_inflight reduce-scatters (buffer + its 1/N output) plus the bucket
    being filled are alive; after backward nothing is."""
    for peak, largest, buckets, after, gradients in run_distributed(2, _peak_bucket_buffers, max_inflight):
        assert buckets > max_inflight + 2  # the bound is below "every bucket at once"
        assert 0 < peak <= (max_inflight * 1.5 + 1) * largest
        assert after == 0 and gradients == 0
