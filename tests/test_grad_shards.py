"""The gradient stores (zeroimpl.grad_shards), in process: on the device, the first reduction of a step is taken as
is and later ones summed; on the host (offload), filled and zeroed shards follow their rules without a host sync
where none is needed."""

import pytest
import torch

from zeroimpl.grad_shards import DeviceGradientShards, HostGradientShards, ShardFill

CPU = torch.device("cpu")


def test_device_store_takes_the_first_reduction_as_is_and_sums_the_rest():
    store = DeviceGradientShards(2)
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25])
    store.add(1, first)
    assert store.ready()[1] is first and store.ready()[0] is None and store.has_gradients
    store.add(1, second)
    assert torch.equal(store.ready()[1], torch.tensor([1.5, 2.25]))
    store.clear(set_to_none=False)
    assert torch.equal(store.ready()[1], torch.zeros(2)) and store.ready()[0] is None
    store.clear(set_to_none=True)
    assert not store.has_gradients


def test_host_store_moves_device_sums_over_when_ready_is_called_inside_accumulating():
    """step() inside accumulating(): the sums kept on the device must reach the host shards, not be dropped."""
    store = HostGradientShards(torch.device("cpu"), [torch.zeros(2), torch.zeros(3)])
    with store.accumulating():
        store.add(0, torch.tensor([1.0, 2.0]))
        store.add(0, torch.tensor([1.0, 1.0]))
        store.add(1, torch.tensor([3.0, 0.0, 1.0]))
        assert store.has_gradients and store.device_tensors()
        ready = store.ready()
    assert torch.equal(ready[0], torch.tensor([2.0, 3.0])) and torch.equal(ready[1], torch.tensor([3.0, 0.0, 1.0]))
    assert not store.device_tensors()


def test_host_store_sums_filled_shards_and_overwrites_zeroed_ones():
    store = HostGradientShards(torch.device("cpu"), [torch.zeros(2)])
    store.add(0, torch.tensor([1.0, 1.0]))
    store.add(0, torch.tensor([2.0, 0.0]))  # not accumulating: summed on the host
    assert torch.equal(store.ready()[0], torch.tensor([3.0, 1.0]))
    store.clear(set_to_none=False)  # a zero gradient that the next reduction replaces
    assert torch.equal(store.ready()[0], torch.zeros(2)) and store.has_gradients
    store.add(0, torch.tensor([5.0, 6.0]))
    assert torch.equal(store.ready()[0], torch.tensor([5.0, 6.0]))
    store.clear(set_to_none=True)
    assert store.ready() == [None] and not store.has_gradients


def test_host_store_fill_states_follow_their_rules():
    store = HostGradientShards(torch.device("cpu"), [torch.zeros(1), torch.zeros(1)])
    store.add(0, torch.ones(1))
    store.clear(set_to_none=False)
    ready = store.ready()  # ZEROED: a zero gradient, stepped as zeros; EMPTY stays empty: not stepped
    assert torch.equal(ready[0], torch.zeros(1)) and ready[1] is None
    assert [fill.value for fill in ShardFill] == ["empty", "filled", "zeroed"]


def test_accumulating_restores_the_previous_setting_even_on_error():
    store = HostGradientShards(torch.device("cpu"), [torch.zeros(1)])
    with pytest.raises(ValueError):
        with store.accumulating():
            with store.accumulating():
                pass
            store.add(0, torch.ones(1))
            assert store.device_tensors()  # still accumulating: kept on the device
            raise ValueError
    store.add(0, torch.ones(1))  # no longer: the sum crosses to the host
    assert not store.device_tensors() and torch.equal(store.ready()[0], torch.full((1,), 2.0))


def test_a_zeroed_host_shard_is_overwritten_without_a_host_sync():
    """zero_grad(set_to_none=False) with offload: the next reduction replaces the zeros as the first one of a step
    does (an asynchronous copy), never the blocking host sum of a shard already filled this step."""
    store = HostGradientShards(torch.device("cpu"), [torch.zeros(2), torch.zeros(3)])
    store.add(0, torch.tensor([1.0, 2.0]))
    store.add(1, torch.tensor([1.0, 2.0, 3.0]))
    store.ready()
    store.clear(set_to_none=False)
    waits = []
    store.wait_copies = lambda: waits.append(1)  # (CPU: no stream; count the host syncs the store asks for)
    store.add(0, torch.tensor([4.0, 5.0]))
    store.add(1, torch.tensor([6.0, 7.0, 8.0]))
    assert waits == [], "a zeroed shard was summed on the host (a host sync per bucket)"
    store.add(0, torch.tensor([1.0, 1.0]))  # a second reduction this step: summed on the host
    assert waits == [1]
    ready = store.ready()
    assert torch.equal(ready[0], torch.tensor([5.0, 6.0])) and torch.equal(ready[1], torch.tensor([6.0, 7.0, 8.0]))