"""What every benchmark study shares: launching ranks, the machine's load, measurement, the workload."""
