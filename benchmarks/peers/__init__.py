"""Benchmark study: Lightning's ddp/FSDP2 and DeepSpeed beside our strategies, same model, one invocation."""
