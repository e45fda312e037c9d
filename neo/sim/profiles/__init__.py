"""Measured ``neo profile`` tables shipped for the simulator's validation and tests:
``qwen2.5-32b-h100-profile.json``, Qwen2.5-32B shapes in bfloat16 on the H100 80GB HBM3 with 15
host attention threads and the ISPC kernel (the engine's default stage order)."""
