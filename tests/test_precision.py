"""The loss scaler (zeroimpl.precision.DynamicLossScaler), in process: hysteresis, growth, its floor and its state
round trip, against the rules DeepSpeed and torch's GradScaler document. Mixed-precision training runs, launched:
test_precision_mixed.py."""

from zeroimpl.precision import DynamicLossScaler, LossScaleConfig


def scaler(**config) -> DynamicLossScaler:
    return DynamicLossScaler(LossScaleConfig(**{"initial_scale": 1024.0, "growth_interval": 2, **config}))


def test_hysteresis_delays_the_backoff_until_that_many_overflows():
    s = scaler(hysteresis=3)
    for expected in (1024.0, 1024.0, 512.0, 256.0):  # once exhausted, every further overflow backs off
        s.update(found_overflow=True)
        assert s.scale == expected
    assert s.skipped_steps == 4


def test_growth_restores_the_hysteresis():
    """overflow -> growth -> overflow: the overflow after a growth is absorbed again (as DeepSpeed does)."""
    s = scaler(hysteresis=2)
    s.update(found_overflow=True)  # absorbed: 1 left
    s.update(found_overflow=False)
    s.update(found_overflow=False)  # growth_interval clean steps: grows, hysteresis back to 2
    assert s.scale == 2048.0
    s.update(found_overflow=True)
    assert s.scale == 2048.0, "the hysteresis was not restored by the growth"
    s.update(found_overflow=True)
    assert s.scale == 1024.0


def test_an_overflow_restarts_the_growth_interval():
    s = scaler(hysteresis=1, growth_interval=3)
    s.update(False), s.update(False), s.update(True), s.update(False), s.update(False)
    assert s.scale == 512.0  # backed off; two clean steps since are not yet an interval
    s.update(False)
    assert s.scale == 1024.0


def test_the_scale_never_drops_below_min_scale():
    s = scaler(hysteresis=1, initial_scale=4.0, min_scale=2.0)
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0


def test_state_round_trip_keeps_the_remaining_hysteresis():
    """A scaler restored after one absorbed overflow backs off at the next one, as the original would."""
    original = scaler(hysteresis=2)
    original.update(found_overflow=True)
    original.update(found_overflow=False)  # one clean step of the growth interval, too
    restored = scaler(hysteresis=2)
    restored.load_state_dict(original.state_dict())
    for s in (original, restored):
        s.update(found_overflow=True)
    assert restored.scale == original.scale == 512.0
    assert restored.state_dict() == original.state_dict()

def test_a_state_counted_past_a_shorter_growth_interval_grows_at_the_next_clean_step():
    """Resumed with a growth interval shorter than the clean steps the state has counted (a converted DeepSpeed run
    with a window of 2000, resumed with the default 1000), the scale grows at the next clean step, not never."""
    s = scaler(growth_interval=1000)
    s.load_state_dict({"scale": 1024.0, "clean_steps": 1499, "hysteresis_left": 2, "skipped_steps": 0})
    s.update(found_overflow=False)
    assert s.scale == 2048.0 and s.state_dict()["clean_steps"] == 0
