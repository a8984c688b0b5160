"""memory_report() against the closed-form bytes of ZeRO stage 1 and 2 (arXiv 1910.02054, section 5),
without and with CPU offload (arXiv 2101.06840).

With Ψp = padded trainable elements, N ranks, p = bytes per parameter element, and on this rank O owned
parameter elements (its shard without padding) in K pieces (parts of one parameter in one shard), and
AdamW (two fp32 moments per element plus one fp32 step counter per piece tensor), without offload, all on
the device:

| kind            | stage 1 after backward | stage 2 after backward | both after step       |
| parameters      | p·Ψp                   | p·Ψp                   | p·Ψp                  |
| gradients       | p·Ψ (full .grad)       | 0                      | 0                     |
| gradient_shard  | 0                      | 4·Ψp/N                 | 0 (the step consumed it) |
| master_weights  | 0 for fp32, 4·Ψp/N for 16-bit                                            |
| optimizer_state | 8·O + 4·K after the first step                                           |
| bucket_buffers  | 0 outside backward and step                                              |

With offload the device keeps parameters and (stage 1, between backward and step) the full ``.grad``; the
host holds gradient_shard 4·Ψp/N (allocated once, at construction), master_weights 4·Ψp/N whatever the
model's dtype, and optimizer_state 8·O + 4·K: about 16 bytes per shard element; for a 16-bit model also
bucket_buffers 2·p·S, two staging buffers of the largest bucket shard S that the masters are converted
into on their way to the device.
"""

from functools import partial

import pytest
import torch

from distributed import case_results, run_cases, run_distributed
from workloads import batch, build_model, param_groups
from zeroimpl import ShardedOptimizer


CONFIGS = [(stage, dtype, offload) for offload in (None, "cpu") for stage in (1, 2)
           for dtype in (torch.float32, torch.bfloat16)]


def _reports(rank, world_size, stage, dtype, offload):
    model = build_model("gpt2", dtype)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, offload=offload,
                                 bucket_numel=4096, lr=1e-3)
    reports = {"init": optimizer.memory_report()}
    for step in range(2):
        optimizer.backward(model(**batch(rank, step, 0)).loss)
        reports[f"backward{step}"] = optimizer.memory_report()
        optimizer.step()
        reports[f"step{step}"] = optimizer.memory_report()
        optimizer.zero_grad()
    layout = optimizer.layout
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    places = {"state": {v.device.type for state in optimizer.inner.state.values() for v in state.values()},
              "masters": {s.master.device.type for s in optimizer.storages},
              "params": {s.param_buffer.device.type for s in optimizer.storages},
              "separate_masters": all(s.has_separate_master for s in optimizer.storages)}
    pieces = layout.pieces(rank)
    sizes = {"padded": layout.padded_numel, "owned": sum(p.length for p in pieces), "pieces": len(pieces), "psi": psi,
             "largest_shard": max(b.shard_numel for b in layout.buckets)}
    return reports, sizes, places


def _expected(stage, dtype, offload, padded, owned, pieces, psi, largest_shard, world_size):
    """The closed form of the table above: {moment: {"device": {...}, "host": {...}}}."""
    p = torch.finfo(dtype).bits // 8
    shard = padded // world_size
    state = 8 * owned + 4 * pieces
    device_master = 0 if dtype == torch.float32 or offload else 4 * shard
    full_grad = p * psi if stage == 1 else 0
    device_shard_after_backward = 4 * shard if stage == 2 and not offload else 0
    device_shard_after_step = 0
    staging = 2 * p * largest_shard if p == 2 else 0
    host = (lambda optimizer_state: dict(gradient_shard=4 * shard, master_weights=4 * shard, bucket_buffers=staging,
                                         optimizer_state=optimizer_state)) if offload else (lambda _: {})

    def place(gradients, gradient_shard, optimizer_state):
        device = dict(parameters=p * padded, gradients=gradients, gradient_shard=gradient_shard,
                      master_weights=device_master, optimizer_state=0 if offload else optimizer_state,
                      bucket_buffers=0)
        return {"device": device, "host": host(optimizer_state)}

    return {"init": place(0, 0, 0),
            "backward0": place(full_grad, device_shard_after_backward, 0),
            "step0": place(0, device_shard_after_step, state),
            "backward1": place(full_grad, device_shard_after_backward, state),
            "step1": place(0, device_shard_after_step, state)}


def _everything(rank, world_size):
    """The reports of every configuration and the bucket-buffer peaks, in one launch of 2 ranks."""
    cases = {("reports", *config): partial(_reports, rank, world_size, *config) for config in CONFIGS}
    for max_inflight in MAX_INFLIGHT:
        cases[("peaks", max_inflight)] = partial(_peak_bucket_buffers, rank, world_size, max_inflight)
    return run_cases(cases)


@pytest.fixture(scope="module")
def runs():
    return run_distributed(2, _everything)


@pytest.mark.parametrize("stage,dtype,offload", CONFIGS)
def test_bytes_match_the_formula(runs, stage, dtype, offload):
    world_size = 2
    for reports, sizes, _ in case_results(runs, ("reports", stage, dtype, offload)):
        expected = _expected(stage, dtype, offload, sizes["padded"], sizes["owned"], sizes["pieces"], sizes["psi"],
                             sizes["largest_shard"], world_size)
        for moment, places in expected.items():
            report = reports[moment]
            for name, place in (("device", report.device), ("host", report.host)):
                kinds = {kind: places[name].get(kind, 0) for kind in place.as_dict() if kind != "total"}
                assert place.as_dict() == {**kinds, "total": sum(kinds.values())}, (moment, name)
            assert report.total == report.device.total + report.host.total


def test_offload_places_state_and_masters_on_the_host(runs):
    """Where each kind lives, from the tensors themselves: with offload the optimizer state and the master
    weights are CPU tensors apart from the parameters (here the device is the CPU too, so the byte
    accounting above is what tells device from host), and host memory is 16 bytes per owned shard element
    (gradient shard and master: 8 per shard element, padding included; state: 8 per owned element), plus
    the two staging buffers."""
    for reports, sizes, places in case_results(runs, ("reports", 2, torch.bfloat16, "cpu")):
        assert places == {"state": {"cpu"}, "masters": {"cpu"}, "params": {"cpu"}, "separate_masters": True}
        host = reports["step1"].host
        staging = 2 * 2 * sizes["largest_shard"]  # two bf16 buffers of the largest shard
        assert host.total == 8 * (sizes["padded"] // 2) + 8 * sizes["owned"] + 4 * sizes["pieces"] + staging
        assert reports["step1"].device.total == 2 * sizes["padded"]  # bf16 parameters, nothing else


def _peak_bucket_buffers(rank, world_size, max_inflight):
    model = build_model("gpt2")
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=2, bucket_numel=2048,
                                 max_inflight_buckets=max_inflight, lr=1e-3)
    peak = [0]

    def observe(_param):  # runs after zeroimpl's own hook on the same parameter
        peak[0] = max(peak[0], optimizer.memory_report().device.bucket_buffers)

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(observe)
    optimizer.backward(model(**batch(rank, 0, 0)).loss)
    after = optimizer.memory_report()
    largest = max(b.padded_numel for b in optimizer.layout.buckets) * 4
    return peak[0], largest, len(optimizer.layout.buckets), after.device.bucket_buffers, after.device.gradients


MAX_INFLIGHT = [0, 2]


@pytest.mark.parametrize("max_inflight", MAX_INFLIGHT)
def test_stage2_bucket_buffers_are_bounded_and_freed(runs, max_inflight):
    """During backward at most max_inflight reduce-scatters (buffer + its 1/N output + the (N-2)/N receive
    buffer of gloo's pairwise exchange, which receives one piece into the output: 1.5 buckets at N = 2) plus
    the bucket being filled are alive; after backward nothing is."""
    for peak, largest, buckets, after, gradients in case_results(runs, ("peaks", max_inflight)):
        assert buckets > max_inflight + 2  # the bound is below "every bucket at once"
        assert 0 < peak <= (max_inflight * 1.5 + 1) * largest
        assert after == 0 and gradients == 0
