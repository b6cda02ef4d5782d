"""fp8-harness: replay scenarios through a BF16 reference and FP8 KV paths; measure, store and report.

The flow, one folder a stage: scenarios -> kv_paths -> replay -> analysis -> judges -> runs (docs/ARCHITECTURE.md).
"""

__version__ = "0.1.0"  # keep equal to pyproject.toml's version (tests/test_cli.py checks)
