"""Benchmarks behind ``lora-cupy bench``: ``kernels`` (on a CUDA device) and ``pool`` (host time)."""
