"""GQA decode over block-scaled caches against torch SDPA BF16: the rows `python -m kernels.bench` prints after the
GQA table (issue 43), and `python -m kernels.bench_block_scaled [--sweep]` alone.

Shape as the GQA table: 32 query / 8 KV heads, head_dim 128, page 16, every sequence the full context. Caches are
filled by the fused write (kernels/store_kv_block_scaled.py) from random bf16 K/V with outlier channels. Columns as
kernels/bench.py's: median GPU ms of one CUDA-graph replay (L2 flushed), host µs of an eager call, GB/s of the
bytes the row must read (codes and block scales; SDPA: bf16 K/V), that over the measured copy bandwidth, speed-up
against torch SDPA BF16 timed in the same rounds, and err: the kernel's max error against fp64 attention over the
stored values over the max error of "dequantise with the torch reference to bf16, then our BF16 decode kernel" on
the same inputs (lengths 1/300/4099/77, shuffled pages): <= 1.00x is the issue's bound.
--sweep first times each format's launch variants (kernels.configs entry first) and uses the fastest whose err is
<= 1.5x (a broken variant errs far above 1).
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import torch
import torch.nn.functional as F

from kernels import reference as ref
from kernels.configs import launch_config
from kernels.decode_attention import decode_attention
from kernels.decode_attention_block_scaled import CONFIG_KINDS, code_bytes, cuda_serves, decode_attention_block_scaled
from kernels.store_kv_block_scaled import quantize_store_block_scaled
from kernels.tune import _ms, _pages, _poison, host_us

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
# row label -> (element, block scale, values per block scale, write target, scale floor, static scale): the formats
# of harness/kv_paths/formats.py as harness/kv_paths/block_layout.py maps them (kernels/ does not import harness)
FORMATS = {
    "NVFP4": ("e2m1", "e4m3", 16, 6.0, 0.0, True),
    "MXFP8": ("e4m3", "e8m0", 32, 0.0, 0.0, False),
    "INT4 per token-head": ("int4", "fp32", 0, 7.0, 1e-6, False),
    "MXFP4": ("e2m1", "e8m0", 32, 0.0, 0.0, False),
    "INT8 per token-head": ("int8", "fp32", 0, 127.0, 1e-6, False),
}
# the targets (speed-up over torch SDPA BF16 at batch 8, 32k), printed beside the rows
TARGETS = {"NVFP4": 3.0, "MXFP8": 1.85, "INT4 per token-head": 2.8}
SWEEP = [dict(block_n=bn, num_warps=w, num_stages=st, asm=asm, programs_per_sm=pps)
         for bn, w, st, asm, pps in [(128, 4, 2, True, 8), (64, 4, 2, True, 8), (64, 4, 2, False, 8),
                                     (128, 4, 2, False, 8), (64, 4, 2, True, 16)]]
SWEEP_SECONDS = 25   # per format: variants past this are not timed (the device time of a run is rationed)


def _layout(label: str) -> tuple[dict, dict, bool]:
    element, block_scale, block, target, floor, static = FORMATS[label]
    kernel = dict(element=element, block_scale=block_scale, block_size=block)
    return kernel, dict(kernel, target=target, scale_floor=floor), static


def _caches(label: str, num_blocks: int, heads: int, dim: int, slots_of, tokens: int):
    """(k codes, v codes, k block scales, v block scales, static scale) filled by the fused write, `tokens` at a
    time: slots_of(start, count) -> their slots."""
    kernel, write, static = _layout(label)
    nbytes = code_bytes(kernel["element"], dim)
    shapes = (num_blocks, PAGE, heads)
    scale = torch.tensor(0.013, device="cuda") if static else None
    caches = []
    channels = torch.logspace(-1, 1, dim, device="cuda")[torch.randperm(dim, device="cuda")]
    for _ in range(2):
        codes = torch.zeros(*shapes, nbytes, dtype=torch.uint8, device="cuda")
        blocks = torch.zeros(shapes, dtype=torch.float32, device="cuda") if kernel["block_scale"] == "fp32" else \
            torch.zeros(*shapes, dim // kernel["block_size"], dtype=torch.uint8, device="cuda")
        for start in range(0, tokens, 1 << 16):
            count = min(1 << 16, tokens - start)
            x = (torch.randn(1, count, heads, dim, device="cuda") * channels).bfloat16().transpose(1, 2)
            quantize_store_block_scaled(x, scale, codes=codes, block_scales=blocks, slots=slots_of(start, count),
                                        page_size=PAGE, **write)
        caches.append((codes, blocks))
    (kc, kb), (vc, vb) = caches
    return kc, vc, kb, vb, scale


def check(label: str, cfg: dict) -> float:
    """Kernel max error / the dequantise-then-our-BF16 kernel's max error, both against fp64 (module docstring)."""
    kernel, _, _ = _layout(label)
    lengths = [1, 300, 4099, 77]
    table, seq, num_blocks = _pages(lengths, PAGE)
    flat = torch.cat([(table[b, :-(-n // PAGE)].long()[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)[:n]
                      for b, n in enumerate(lengths)])
    kc, vc, kb, vb, scale = _caches(label, num_blocks, KV_HEADS, HEAD_DIM, lambda s, c: flat[s:s + c], flat.numel())
    q = torch.randn(len(lengths), Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    sm = HEAD_DIM ** -0.5
    _poison()
    out = decode_attention_block_scaled(q, kc, vc, kb, vb, table, seq, scale, scale, sm, **kernel, **cfg)[0]
    k, v = (ref.dequantize_block_scaled(c, b, scale, **kernel) for c, b in ((kc, kb), (vc, vb)))
    dequantised = decode_attention(q, k.bfloat16(), v.bfloat16(), table, seq, None, None, sm)[0]
    worst, worst_dequantised = 0.0, 0.0
    for b, n in enumerate(lengths):
        rows = flat[sum(lengths[:b]):sum(lengths[:b]) + n]
        kk, vv = (t.view(-1, KV_HEADS, HEAD_DIM)[rows].double().repeat_interleave(Q_HEADS // KV_HEADS, 1) for t in (k, v))
        s = torch.einsum("hd,lhd->hl", q[b].double(), kk) * sm
        truth = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv)
        err = (out[b].double() - truth).abs().max().item()
        worst = float("nan") if math.isnan(err) else max(worst, err)
        worst_dequantised = max(worst_dequantised, (dequantised[b].double() - truth).abs().max().item())
    return worst / worst_dequantised if math.isfinite(worst) else float("inf")


def bytes_per_token(label: str) -> int:
    """K + V bytes a token takes (all KV heads): codes and block scales."""
    kernel, _, _ = _layout(label)
    scale_bytes = 4 if kernel["block_scale"] == "fp32" else HEAD_DIM // kernel["block_size"]
    return 2 * KV_HEADS * (code_bytes(kernel["element"], HEAD_DIM) + scale_bytes)


def _config(label: str, tuned: dict) -> dict:
    """The launch keywords of a format's row: the tuned variant, else its entry (without impl: the launcher picks the
    entry's kernel where it serves the format, e.g. the CUDA kernel for NVFP4 but not MXFP4 under one entry)."""
    kind = CONFIG_KINDS[FORMATS[label][0]]
    cfg = tuned.get(kind) or launch_config(kind, torch.device("cuda", torch.cuda.current_device()))
    return {k: v for k, v in cfg.items() if k != "impl"}


def _cuda_row(label: str) -> bool:
    """Whether the format's entry runs the CUDA kernel (impl="cuda" over a layout it reads); its Triton row is printed
    beside."""
    kind = CONFIG_KINDS[FORMATS[label][0]]
    return launch_config(kind, torch.device("cuda", torch.cuda.current_device())).get("impl") == "cuda" and \
        cuda_serves(*FORMATS[label][:3])


def bench(batch: int, ctx: int, tuned: dict, labels=tuple(FORMATS)) -> list[tuple] | None:
    """[(method, ms, bytes read, host µs, err)]: torch SDPA BF16 first, then each format's row."""
    table = torch.arange(batch * ctx // PAGE, dtype=torch.int32, device="cuda").view(batch, -1)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    sm = HEAD_DIM ** -0.5
    k_sdpa, v_sdpa = (torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_rows = q.view(batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
    sdpa = lambda: F.scaled_dot_product_attention(q_rows, k_sdpa, v_sdpa, scale=sm)  # noqa: E731
    fns = {"torch SDPA BF16": sdpa}
    caches = {}
    for label in labels:
        caches[label] = _caches(label, batch * ctx // PAGE, KV_HEADS, HEAD_DIM,
                                lambda s, c: torch.arange(s, s + c, device="cuda"), batch * ctx)
        kc, vc, kb, vb, scale = caches[label]
        kernel, _, _ = _layout(label)
        fns[f"ours {label}"] = functools.partial(decode_attention_block_scaled, q, kc, vc, kb, vb, table, seq, scale,
                                                 scale, sm, **kernel, **_config(label, tuned))
        if _cuda_row(label):   # the Triton kernel it replaces, in the same rounds
            fns[f"ours {label}, Triton"] = functools.partial(fns[f"ours {label}"], impl="triton")
    first = {name: _ms(fn) for name, fn in fns.items()}
    second = {name: _ms(fn) for name, fn in fns.items()}
    rows = [("torch SDPA BF16", second["torch SDPA BF16"], 4 * batch * ctx * KV_HEADS * HEAD_DIM, host_us(sdpa), 1.0)]
    for label in labels:
        for name, impl in ((f"ours {label}", None), (f"ours {label}, Triton", "triton")):
            if name in fns:
                rows.append((name, second[name], batch * ctx * bytes_per_token(label), host_us(fns[name]),
                             check(label, dict(_config(label, tuned), impl=impl))))
    spread = max(abs(first[n] - second[n]) / second[n] for n in fns)
    return rows + [("(largest round-1 vs round-2 difference)", spread, 0, None, None)]


def sweep(batch: int = 8, ctx: int = 32768, labels=tuple(FORMATS)) -> tuple[list[str], dict]:
    """Each format's variants (its configs entry first) at one shape: lines of a table and the fastest whose err
    is <= 1.5x, per config kind."""
    device = torch.device("cuda", torch.cuda.current_device())
    table = torch.arange(batch * ctx // PAGE, dtype=torch.int32, device="cuda").view(batch, -1)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    lines = [f"### Block-scaled launch variants, batch {batch}, context {ctx} (ms, err)", "",
             "| format | variant | programs/SM | ms | speed-up vs SDPA BF16 | err |", "|---|---|---:|---:|---:|---:|"]
    k_sdpa, v_sdpa = (torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_rows = q.view(batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
    sdpa_ms = _ms(lambda: F.scaled_dot_product_attention(q_rows, k_sdpa, v_sdpa, scale=HEAD_DIM ** -0.5))
    k_sdpa = v_sdpa = None
    lines[0] += f"; torch SDPA BF16 {sdpa_ms:.4f} ms"
    print(lines[0], flush=True)
    tuned = {}
    for label in labels:
        kind = CONFIG_KINDS[FORMATS[label][0]]
        if kind in tuned:
            continue
        kc, vc, kb, vb, scale = _caches(label, batch * ctx // PAGE, KV_HEADS, HEAD_DIM,
                                        lambda s, c: torch.arange(s, s + c, device="cuda"), batch * ctx)
        kernel, _, _ = _layout(label)
        entry = launch_config(kind, device)
        best = None
        started = time.perf_counter()
        for variant in [{}] + SWEEP:
            if time.perf_counter() - started > SWEEP_SECONDS:
                lines.append(f"| {label} | {variant} | | not timed: {SWEEP_SECONDS} s spent | |")
                continue
            cfg = {k: v for k, v in dict(entry, **variant).items() if k != "impl"}
            if variant:
                cfg["impl"] = "triton"   # the variants are the Triton kernel's
            pps = cfg["programs_per_sm"]
            try:
                ms = _ms(lambda: decode_attention_block_scaled(q, kc, vc, kb, vb, table, seq, scale, scale,
                                                               HEAD_DIM ** -0.5, **kernel, **cfg))
                err = check(label, cfg)
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is reported, not used
                lines.append(f"| {label} | {variant or 'entry'} | {pps} | failed: {type(e).__name__}: {str(e)[:120]} | |")
                continue
            lines.append(f"| {label} | {variant or 'entry'} | {pps} | {ms:.4f} | {sdpa_ms / ms:.2f}x | {err:.2f}x |")
            print(lines[-1], flush=True)
            if err <= 1.5 and (best is None or ms < best[0]):   # a broken variant errs far above 1
                best = (ms, cfg)
        kc = vc = kb = vb = None
        torch.cuda.empty_cache()
        if best is not None:
            tuned[kind] = best[1]
    return lines + [""], tuned


def table_lines(batches, contexts, tuned: dict, copy_bw: float) -> list[str]:
    lines = [f"### GQA decode over block-scaled caches, {Q_HEADS} q / {KV_HEADS} kv heads, head_dim {HEAD_DIM}", "",
             "| batch | context | method | GPU ms (graph) | host µs/call | GB/s | of copy BW | speed-up vs SDPA BF16 | "
             "target | err vs dequantised bf16 |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for batch in batches:
        for ctx in contexts:
            torch.cuda.empty_cache()
            if 2 * 4 * batch * ctx * KV_HEADS * HEAD_DIM > 0.6 * torch.cuda.mem_get_info()[0]:
                lines.append(f"| {batch} | {ctx} | skipped: does not fit in GPU memory | | | | | | | |")
                continue
            rows = bench(batch, ctx, tuned)
            base = rows[0][1]
            for method, ms, nbytes, host, err in rows[:-1]:
                gbs = nbytes / (ms * 1e-3) / 1e9
                target = TARGETS.get(method.removeprefix("ours "))
                lines.append(f"| {batch} | {ctx} | {method} | {ms:.4f} | {'-' if host is None else f'{host:.0f}'} | "
                             f"{gbs:.0f} | {gbs * 1e9 / copy_bw:.0%} | {base / ms:.2f}x | "
                             f"{'-' if target is None else f'>= {target:.2f}x'} | {err:.2f}x |")
                print(lines[-1], flush=True)
            lines.append(f"| {batch} | {ctx} | rows timed twice, round 2 shown; largest round-1 vs round-2 difference "
                         f"{rows[-1][1]:.1%} | | | | | | | |")
    return lines + [""]


# MLA over a block-scaled latent (mla_decode_block_scaled): DeepSeek's shape, latent 512 + RoPE 64 (bf16), against
# our BF16 MLA kernel (kernels/mla_decode.py over a bf16 [c | k_pe] cache); issue 43's target for NVFP4 at 16 heads
MLA_LATENT, MLA_ROPE = 512, 64
MLA_FORMATS = ("NVFP4", "NVFP4, one record", "fp8_ds_mla", "fp8_ds_mla, three tensors", "MXFP8", "MXFP8, one record",
               "MXFP4", "MXFP4, one record")
# vLLM's fp8_ds_mla latent (e4m3, an fp32 scale per tile of 128 = max(amax / 448, FLT_MIN)); MLA only, so not in FORMATS
DS_MLA = dict(element="e4m3", block_scale="fp32", block_size=128)
MLA_TARGETS = {"NVFP4": 2.2}


def _mla_latent(label: str, x: torch.Tensor, blocks: int, k_pe: torch.Tensor) -> tuple:
    """(codes, block scales, static scale, kernel keywords, k_pe) of a paged latent holding x [tokens, 1, 512] fp32;
    fp8_ds_mla in vLLM's byte record [codes | 4 fp32 scales | k_pe] (the engine's pages), or in three tensors."""
    if label.startswith("fp8_ds_mla"):   # the torch encode (the fused write takes no fp32 scales per block)
        record = torch.empty(blocks * PAGE, MLA_LATENT + 16 + 2 * MLA_ROPE, dtype=torch.uint8, device="cuda")
        codes, scales = record[:, :MLA_LATENT], record[:, MLA_LATENT:MLA_LATENT + 16].view(torch.float32)
        for start in range(0, blocks * PAGE, 1 << 16):
            tiles = x[start:start + (1 << 16), 0].bfloat16().float().view(-1, MLA_LATENT // 128, 128)
            part = (tiles.abs().amax(-1) / 448.0).clamp(min=2.0 ** -126)   # 448 = largest finite e4m3
            scales[start:start + (1 << 16)] = part
            codes[start:start + (1 << 16)] = (tiles / part[..., None]).to(torch.float8_e4m3fn).view(torch.uint8) \
                .view(-1, MLA_LATENT)
        pe = record[:, MLA_LATENT + 16:].view(k_pe.dtype)
        pe.copy_(k_pe.view(-1, MLA_ROPE))
        parts = (codes, scales, pe)
        if label != "fp8_ds_mla":
            parts = tuple(t.contiguous() for t in parts)
            record = None
        codes, scales, pe = (t.view(blocks, PAGE, *t.shape[1:]) for t in parts)
        return codes.unsqueeze(2), scales.unsqueeze(2), None, DS_MLA, pe
    if label.endswith(", one record"):   # [codes | block scales | k_pe] a token, as the fp8_ds_mla record
        codes, scales, scale, kernel, pe = _mla_latent(label.removesuffix(", one record"), x, blocks, k_pe)
        parts = [t.reshape(blocks * PAGE, -1).view(torch.uint8) for t in (codes, scales, pe)]
        record = torch.cat(parts, dim=-1).view(blocks, PAGE, -1)
        ends = [0, *torch.tensor([t.shape[-1] for t in parts]).cumsum(0).tolist()]
        codes, scales, pe = (record[..., a:b] for a, b in zip(ends, ends[1:]))
        return codes.unsqueeze(2), scales.unsqueeze(2), scale, kernel, pe.view(k_pe.dtype)
    kernel, write, _ = _layout(label)
    nbytes = code_bytes(kernel["element"], MLA_LATENT)
    codes = torch.zeros(blocks, PAGE, 1, nbytes, dtype=torch.uint8, device="cuda")
    scales = torch.zeros(blocks, PAGE, 1, MLA_LATENT // kernel["block_size"], dtype=torch.uint8, device="cuda")
    scale = torch.tensor(0.01, device="cuda") if FORMATS[label][5] else None
    # the fused write takes heads of up to 256: the latent as two heads of 256 (the same bytes: blocks of 16 or 32
    # never straddle them, and the static scale is one value)
    halves = dict(codes=codes.view(blocks, PAGE, 2, nbytes // 2), block_scales=scales.view(blocks, PAGE, 2, -1))
    for start in range(0, blocks * PAGE, 1 << 16):
        count = min(1 << 16, blocks * PAGE - start)
        quantize_store_block_scaled(x[start:start + count].view(1, count, 2, MLA_LATENT // 2).bfloat16()
                                    .transpose(1, 2), scale, slots=torch.arange(start, start + count, device="cuda"),
                                    page_size=PAGE, **halves, **write)
    return codes, scales, scale, kernel, k_pe


def mla_lines(batch: int, ctx: int, heads: int) -> list[str]:
    """Rows of MLA decode at one shape: our BF16 kernel, then each block-scaled latent (ms, speed-up, error against
    fp64 over the stored values relative to the dequantised latent through our BF16 kernel, batch row 0)."""
    from kernels import mla_block_scaled_cuda
    from kernels.decode_attention_block_scaled import mla_decode_block_scaled
    from kernels.mla_decode import mla_decode

    blocks = batch * ctx // PAGE
    table = torch.arange(blocks, dtype=torch.int32, device="cuda").view(batch, -1)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q_latent = (torch.randn(batch, heads, MLA_LATENT, device="cuda") * 0.5).bfloat16()
    q_pe = (torch.randn(batch, heads, MLA_ROPE, device="cuda") * 0.5).bfloat16()
    sm = (MLA_LATENT + MLA_ROPE) ** -0.5
    k_pe = (torch.randn(blocks, PAGE, MLA_ROPE, device="cuda") * 4).bfloat16()
    x = torch.randn(blocks * PAGE, 1, MLA_LATENT, device="cuda") * torch.logspace(-1, 1, MLA_LATENT, device="cuda")
    cache = torch.cat([x[:, 0].view(blocks, PAGE, MLA_LATENT), k_pe.float()], -1).bfloat16()
    bf16_ms = _ms(lambda: mla_decode(q_latent, q_pe, cache, table, seq, None, sm))
    lines = [f"| {batch} | {ctx} | {heads} | ours MLA BF16 | {bf16_ms:.4f} | 1.00x | - | - |"]
    cache = None
    for label in MLA_FORMATS:
        codes, scales, scale, kernel, latent_pe = _mla_latent(label, x, blocks, k_pe)
        latent = ref.dequantize_block_scaled(codes[:ctx // PAGE], scales[:ctx // PAGE], scale, **kernel)[:, :, 0]
        rows = torch.cat([latent, k_pe[:ctx // PAGE].float()], -1).view(ctx, -1).double()
        s = (torch.cat([q_latent[0], q_pe[0]], -1).double() @ rows.T) * sm
        truth = torch.softmax(s, -1) @ rows[:, :MLA_LATENT]
        one = lambda t: t[:1]  # noqa: E731
        dequantised = mla_decode(one(q_latent), one(q_pe), torch.cat([latent, k_pe[:ctx // PAGE].float()], -1)
                                 .bfloat16(), one(table), one(seq), None, sm)[0][0]
        # the entry (a CUDA kernel: kernels/mla_decode_latent_split.cu for records, else kernels/
        # mla_decode_block_scaled.cu, the "tile kernel" beside the records'), and the Triton kernel beside it
        impls = {"NVFP4": (None, "triton"), "MXFP8": (None, "triton"), "MXFP4": (None, "triton")}.get(
            label, (None, "tile") if label.endswith("one record") or label == "fp8_ds_mla" else (None,))
        for impl in impls:
            def fn(impl=impl):
                if impl == "tile":
                    return mla_block_scaled_cuda.decode(q_latent, q_pe, codes, scales, latent_pe, table, seq, scale,
                                                        sm, None, tuple(kernel.values()), latent_split=False)
                return mla_decode_block_scaled(q_latent, q_pe, codes, scales, latent_pe, table, seq, scale, sm,
                                               **kernel, impl=impl)
            ms = _ms(fn)
            ours = fn()[0][0]
            err = (ours.double() - truth).abs().max().item() / (dequantised.double() - truth).abs().max().item()
            target = MLA_TARGETS.get(label.split(",")[0]) if impl is None else None
            name = f"ours MLA {label}" + {"triton": ", Triton", "tile": ", tile kernel"}.get(impl, "")
            lines.append(f"| {batch} | {ctx} | {heads} | {name} | {ms:.4f} | {bf16_ms / ms:.2f}x | "
                         f"{'-' if target is None else f'>= {target:.2f}x'} | {err:.2f}x |")
            print(lines[-1], flush=True)
        codes = scales = latent_pe = None
        torch.cuda.empty_cache()
    return lines


def main() -> None:
    from kernels.bench import copy_bandwidth

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time each format's launch variants first")
    parser.add_argument("--batches", default="8")
    parser.add_argument("--contexts", default="32768")
    parser.add_argument("--mla-heads", default="16", help="MLA rows at these head counts ('' for none)")
    parser.add_argument("--no-gqa", action="store_true", help="the MLA rows only")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    copy_bw = copy_bandwidth()
    tuned = {}
    out = []
    if args.sweep:
        lines, tuned = sweep()
        out += lines
        print("\n".join(lines) + f"\nchosen: {tuned}", flush=True)
    batches, contexts = [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
    if not args.no_gqa:
        out += table_lines(batches, contexts, tuned, copy_bw)
    if args.mla_heads:
        out += [f"### MLA decode over a block-scaled latent ({MLA_LATENT} + RoPE {MLA_ROPE} bf16), against our BF16 "
                "MLA kernel", "", "| batch | context | heads | method | GPU ms (graph) | speed-up vs our BF16 | target | "
                "err vs dequantised bf16 |", "|---:|---:|---:|---|---:|---:|---:|---:|"]
        for heads in (int(h) for h in args.mla_heads.split(",")):
            for batch in batches:
                for ctx in contexts:
                    out += mla_lines(batch, ctx, heads)
        out.append("")
    print("\n" + "\n".join(out))


if __name__ == "__main__":
    main()
