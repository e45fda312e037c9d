"""Benchmarking: the offline throughput benchmark and its workloads (synthetic, the bundled
trace, trace files)."""

from .offline import device_name, release_device_memory, run_offline_benchmark

__all__ = ["device_name", "release_device_memory", "run_offline_benchmark"]
