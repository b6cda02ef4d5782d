"""Stage 4, running the model: the backend interface, in-process and endpoint backends, the replay runner.

May import: every earlier stage (types, records, scenarios, canary, kv_paths, analysis); writes to a store it is given.
"""
