"""`python benchmarks/prefill_memo.py ARCH` (gqa | mla | hybrid): CPU process time of one path's turns (generate, then score the reference reply on the same prompt) with the
prefill kept (PrefillMemo) and without (scoring prefills again), on the canary recall scenarios' first turns."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import job  # noqa: E402
from harness.kv_paths.spec import parse_path  # noqa: E402
from harness.replay.inprocess import InProcessModel  # noqa: E402
from harness.replay.runner import _messages  # noqa: E402
from harness.scenarios.select import select_scenarios  # noqa: E402
from harness.scenarios.sources import load_scenarios  # noqa: E402

torch.set_num_threads(1)
arch = sys.argv[1]
model = InProcessModel.load(job.CANARY_WEIGHTS / arch)
scenarios = select_scenarios(load_scenarios(list(job.default_scenarios())), ("kind:recall",))
prompts = [_messages(s, [], 0) for s in scenarios]
backend = model.backend(parse_path("fp8_e4m3"))
for keep in (True, False, True, False):
    start = time.process_time()
    for messages in prompts:
        reply = backend.generate_sync(messages, 24)
        if not keep:
            backend.prefills.entries.clear()
            backend.prefills.held = 0
        backend.score_sync(messages, reply.token_ids)
    print(arch, "prefill kept" if keep else "scoring prefills again", f"{time.process_time() - start:.2f} s CPU",
          [len(model.encode_chat(m)) for m in prompts], flush=True)
