"""Stage 1, what to replay: scenario files loaded and validated, filler text, answer and rule checks.

May import: `harness.types`, `harness.records`.
"""
