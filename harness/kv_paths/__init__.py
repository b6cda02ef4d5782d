"""Stage 2, how K/V are cached: path specs, FP8 cache layers, where scales come from, the attention function.

May import: `harness.types`, `harness.records`, `harness.scenarios`, `harness.canary`, `kernels`.
"""
