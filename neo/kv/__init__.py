"""The KV pools: the compute device's and the host's cache tensors, the host memory they live
in, and how much device memory the device pool gets."""
