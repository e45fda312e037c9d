"""Benchmarking: the offline throughput benchmark, workloads, and the bundled trace."""

from .offline import device_name, release_device_memory, run_offline_benchmark

__all__ = ["device_name", "release_device_memory", "run_offline_benchmark"]
