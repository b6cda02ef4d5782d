"""The models we ship and how we make them: canary tokenizer, corpus, training, tiny random-weight models.

May import: `harness.types`, `harness.records`, `harness.scenarios`; its command-line tools (train, retrain,
record_accuracy, make_scenarios) are entry points and may import anything.
"""
