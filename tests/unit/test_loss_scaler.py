"""Dynamic loss scaler semantics (ColossalAI's: hysteresis before back-off, reset only on growth)."""

from lightning_colossal.config import LossScalerConfig
from lightning_colossal.precision import DynamicLossScaler


def test_backs_off_only_after_hysteresis_overflows_then_at_once():
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale=1024.0, hysteresis=2, growth_interval=100))
    scaler.update(found_overflow=True)
    assert scaler.scale == 1024.0  # first overflow tolerated
    scaler.update(found_overflow=True)
    assert scaler.scale == 512.0
    scaler.update(found_overflow=False)
    scaler.update(found_overflow=True)
    # the hysteresis counter resets only when the scale grows, so a later overflow backs off at once
    assert scaler.scale == 256.0
    assert scaler.skipped_steps == 3


def test_grows_after_growth_interval_clean_steps_and_respects_bounds():
    config = LossScalerConfig(initial_scale=4.0, growth_interval=3, hysteresis=1, min_scale=2.0, max_scale=8.0)
    scaler = DynamicLossScaler(config)
    for _ in range(3):
        scaler.update(found_overflow=False)
    assert scaler.scale == 8.0
    for _ in range(3):
        scaler.update(found_overflow=False)
    assert scaler.scale == 8.0  # capped at max_scale
    for _ in range(5):
        scaler.update(found_overflow=True)
    assert scaler.scale == 2.0  # floored at min_scale


def test_overflow_interrupts_growth_streak():
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale=16.0, growth_interval=2, hysteresis=5))
    scaler.update(found_overflow=False)
    scaler.update(found_overflow=True)
    scaler.update(found_overflow=False)
    assert scaler.scale == 16.0
    scaler.update(found_overflow=False)
    assert scaler.scale == 32.0


def test_state_round_trip():
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale=64.0, hysteresis=3))
    scaler.update(found_overflow=True)
    scaler.update(found_overflow=False)
    restored = DynamicLossScaler(LossScalerConfig(initial_scale=64.0, hysteresis=3))
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    scaler.update(found_overflow=True)
    scaler.update(found_overflow=True)
    restored.update(found_overflow=True)
    restored.update(found_overflow=True)
    assert restored.scale == scaler.scale == 32.0
