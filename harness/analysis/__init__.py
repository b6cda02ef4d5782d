"""Stage 3, what a record says: divergence metrics, threshold checks; pure functions on plain data.

May import: `harness.types`, `harness.records`, `harness.scenarios`, `harness.kv_paths`.
"""
