"""Settings objects reject bad values with a message that names the fix."""

import pytest

from lightning_colossal.config import DDPConfig, LossScalerConfig, validate_precision, validate_start_method
from lightning_colossal.distributed import ParallelDims


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"initial_scale": 0.0}, "initial_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": 4.0, "max_scale": 2.0, "initial_scale": 3.0}, "min_scale"),
        ({"initial_scale": 2.0**40}, "outside"),
    ],
)
def test_loss_scaler_config_rejects_bad_values(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        LossScalerConfig(**kwargs)


def test_ddp_config_rejects_bad_values():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDPConfig(bucket_cap_mb=0)
    with pytest.raises(ValueError, match="gradient_compression"):
        DDPConfig(gradient_compression="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pick one"):
        DDPConfig(static_graph=True, find_unused_parameters=True)
    assert DDPConfig(gradient_compression="bf16").gradient_compression == "bf16"


def test_precision_and_start_method_validation():
    assert validate_precision("bf16-mixed") == "bf16-mixed"
    with pytest.raises(ValueError, match="16-mixed"):
        validate_precision("16-true")
    with pytest.raises(ValueError, match="32-true"):
        validate_precision("64-true")
    with pytest.raises(ValueError, match="Choose one of"):
        validate_precision("fp8")
    with pytest.raises(ValueError, match="notebooks"):
        validate_start_method("thread")


def test_parallel_dims_derives_and_validates_data_parallel_size():
    dims = ParallelDims(world_size=8, tp=2, pp=2)
    assert dims.data_parallel_size == 2
    assert dims.axis_sizes() == {"pp": 2, "dp": 2, "sp": 1, "tp": 2}
    with pytest.raises(ValueError, match="does not divide"):
        ParallelDims(world_size=6, tp=4)
    with pytest.raises(ValueError, match="leave dp_size unset"):
        ParallelDims(world_size=8, tp=2, dp=2)
    with pytest.raises(ValueError, match="tp_size"):
        ParallelDims(world_size=2, tp=0)
