"""Execution: runs the scheduler's plans on the compute device and the host CPU and decides
nothing the scheduler must predict. Batch inputs, the executor that walks a stage order, the
host attention hand-off, CUDA graphs, sampling, and the profiler that measures stage times."""
