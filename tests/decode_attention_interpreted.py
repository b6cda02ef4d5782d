"""The GQA decode kernel's attention beyond SDPA (sinks, soft-capping, each row's first key) under Triton's CPU
interpreter (TRITON_INTERPRET=1, set before triton is imported): run by tests/test_kernels_reference.py in a
subprocess. An fp16 cache and query: the interpreter truncates fp32 -> bf16 (the block-scaled kernels' note) and
mis-rounds fp32 -> fp8, so neither is read here; this checks the kernel's logic, not its speed or a GPU's arithmetic.
Prints one JSON object: {case: {"kernel_vs_mirror": max |out diff|, "moved": max |out - plain attention|}}."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.decode_attention import decode_attention  # noqa: E402

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 3, 8, 2, 64, 16
LENGTHS = torch.tensor([5, 70, 130], dtype=torch.int32)  # a row shorter than the window, rows over several splits


def main() -> None:
    torch.manual_seed(0)
    pages = -(-LENGTHS // PAGE)
    table = torch.zeros(BATCH, int(pages.max()), dtype=torch.int32)
    order = torch.randperm(int(pages.sum()) + 2).int()  # shuffled pages, two nobody owns
    for row, owned in enumerate(order[:int(pages.sum())].split(pages.tolist())):
        table[row, :len(owned)] = owned
    k = torch.randn(int(pages.sum()) + 2, PAGE, KV_HEADS, HEAD_DIM).half()
    v = torch.randn_like(k)
    q = (torch.randn(BATCH, Q_HEADS, HEAD_DIM) * 3).half()  # scores of several units: a cap of 2 bends them
    sinks = torch.randn(Q_HEADS)
    window = (LENGTHS - 32).clamp(min=0).int()
    cases = {"sinks": dict(sinks=sinks), "softcap": dict(softcap=2.0), "window": dict(first_key=window),
             "chunked": dict(first_key=((LENGTHS - 1) // 64 * 64).int()),
             "all": dict(sinks=sinks, softcap=2.0, first_key=window)}
    scale = HEAD_DIM ** -0.5
    plain, _ = ref.decode_attention(q, k, v, table, LENGTHS, None, None, scale)
    found = {}
    for name, features in cases.items():
        want, _ = ref.decode_attention(q, k, v, table, LENGTHS, None, None, scale, **features)
        for splits in (1, 3):
            for prefetch in (False, True):
                out, _ = decode_attention(q, k, v, table, LENGTHS, None, None, scale, num_splits=splits,
                                          prefetch=prefetch, block_n=16, **features)
                found[f"{name}-splits{splits}-prefetch{int(prefetch)}"] = {
                    "kernel_vs_mirror": (out.float() - want.float()).abs().max().item(),
                    "moved": (want.float() - plain.float()).abs().max().item()}
    print(json.dumps(found))


if __name__ == "__main__":
    main()
