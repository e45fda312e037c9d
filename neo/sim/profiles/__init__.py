"""Measured ``neo profile`` tables shipped for the simulator's validation and tests:

- ``qwen2.5-32b-h100-profile.json``: Qwen2.5-32B shapes in bfloat16 on the H100 80GB HBM3 with 15
  host attention threads and the ISPC kernel (the engine's default stage order).
- ``llama-3.1-70b-tp2-h200-profile.json``: Llama-3.1-70B shapes in bfloat16, one rank of two
  (tensor parallelism over two NVIDIA H200s of one 32-core host, its collectives included), 15
  host attention threads per rank, the ISPC kernel: ``neo simulate --tensor-parallel-size 2``.
- ``llama-3.1-8b-h200-profile.json`` and ``qwen2.5-32b-h200-profile.json``: Llama-3.1-8B and
  Qwen2.5-32B shapes in bfloat16 on one NVIDIA H200 with a 16-core host, 15 host attention
  threads and the ISPC kernel, measured in one machine start whose host read slowly (a read probe
  of 74 GB/s, where other starts of that machine read 86-103): their host attention points are
  on the slow side of that machine's.
"""
