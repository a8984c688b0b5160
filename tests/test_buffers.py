"""The buckets' memory (zeroimpl.buffers), in process: parameters edited outside the optimizer reach the masters,
and are compared once."""

import torch

from zeroimpl.buffers import BucketStorage, flatten_params
from zeroimpl.layout import ParamSpec, build_layout


def test_sync_master_with_params_compares_an_edited_parameter_once():
    """bf16 parameters (separate fp32 masters): an in-place edit is taken into the master at the next sync; the
    sync after that, with no edit in between, compares nothing."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, generator=generator).bfloat16()),
              torch.nn.Parameter(torch.randn(4, generator=generator).bfloat16())]
    layout = build_layout([ParamSpec(0, str(p.dtype), p.numel()) for p in params], world_size=2,
                          bucket_numel=1 << 10, alignment=1)
    storages = flatten_params(layout, params, rank=0)
    with torch.no_grad():
        params[0].mul_(2)  # an edit under no_grad: its version counter moves
    compared = []
    original = BucketStorage.published_values  # what the shard holds unedited: each comparison starts there
    BucketStorage.published_values = lambda self: compared.append(1) or original(self)
    try:
        for storage in storages:
            storage.sync_master_with_params()
        assert compared, "the edit was not looked at"
        assert all(torch.equal(s.master, s.shard.float()) for s in storages)  # the edit reached the master
        compared.clear()
        for storage in storages:
            storage.sync_master_with_params()
        assert compared == [], "a sync with no edit since the last one compared the shard again"
    finally:
        BucketStorage.published_values = original