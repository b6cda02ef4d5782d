"""Bit-exact CPU shortcuts: the same bits as the model's own CPU code, with less work.

Two costs dominate a CPU replay of the canaries on a machine without native bf16 kernels (AVX2, no AVX-512 BF16;
BENCHMARKS.md, "the default CPU run under AVX2"), and neither needs the work it does:

- **MLA latent expansion.** transformers' DeepSeek-V3 attention caches the latent and passes the whole of it
  through `kv_b_proj` at every decode step, so a reply of n tokens costs O(n^2) GEMM rows. Each output row depends
  only on its input row (the GEMM's reduction runs along a row; checked below on this machine), so the rows of the
  cached prefix are kept from the step before and only the new rows are multiplied.
- **Depthwise causal conv1d in bf16** (the gated-delta-rule layers of Qwen3-Next-style hybrids): torch runs it as one
  small GEMM per channel where oneDNN has no bf16 kernel, 2-3 ms a call. In float32 the same four-tap sums are
  one oneDNN call; the products of two bf16 numbers are exact in float32 and the sum runs in the same order, so
  rounding the float32 result to bf16 gives torch's bf16 bits (checked below on this machine).

- **bf16 linear layers** where oneDNN has no bf16 kernels: torch's fallback is one dot product per output, 6-8 GMAC/s
  on a core. `kernels/cpu_kernels.py` (C, compiled at first use) adds the same products in the same order (8
  registers of 8 lanes, then the same pairwise trees) with its lanes over 8 outputs instead, so one weight load
  serves 4 input rows: 2.6-2.9x torch's speed at 512 rows, 1.2-1.4x at one row on the canaries' larger layers (AVX2
  dispatch, one core of the dev machine). It keeps a packed copy of each weight it serves (as large as the weight).

Nothing here is assumed: `install` probes each shortcut against the call it replaces, on this machine, with the
model's own weights and shapes and inputs spread over 24 binades (so that sums round), and installs it only where
every bit agrees. The conv shortcut is installed only where oneDNN lacks bf16 (where it is the faster of the two).
What was installed, and why not where not, is part of the model's description in the run's manifest.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

from kernels import cpu_kernels


def install(model: torch.nn.Module) -> dict[str, str]:
    """Install the shortcuts that are bit-exact on this machine for this CPU model; {shortcut: what happened}."""
    if next(model.parameters()).device.type != "cpu":
        return {}
    done = {}
    expanders = [m for m in model.modules() if _is_mla_attention(m)]
    if expanders:
        done["mla_latent_rows"] = _install_latent_rows(expanders)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv1d) and m.groups == m.in_channels > 1]
    module = sys.modules.get(type(model).__module__)
    if convs and module is not None and getattr(module, "F", None) is F:
        done["depthwise_conv1d_fp32"] = _install_conv(module, convs)
    # plain `nn.Linear` layers only (and our kv_b_proj): a subclass may have a forward of its own (MoE routers
    # subclass it and return (logits, weights, experts)); not a tensor-parallel rank's DTensor weight
    linears = [m for m in model.modules() if type(m) in (torch.nn.Linear, LatentRowsLinear) and m.bias is None
               and m.weight.dtype == torch.bfloat16 and type(m.weight.data) is torch.Tensor]
    if linears:
        done["bf16_linear_in_order"] = _install_linear(linears)
    return done


# -- MLA: kv_b_proj over the cached latent, only the new rows -------------------------------------------------------

def _is_mla_attention(module) -> bool:
    return isinstance(getattr(module, "kv_b_proj", None), torch.nn.Linear) and hasattr(module, "kv_lora_rank")


class LatentRowsLinear(torch.nn.Linear):
    """`kv_b_proj` that keeps its last input and output: a call with another number of rows whose leading rows
    (dim -2) are bit-equal to the last call's multiplies only the rows after them. Only for the dtype its rows were checked in (`exact_dtype`)."""

    exact_dtype: torch.dtype | None = None
    _kept: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept, self._kept = self._kept, None
        if x.dtype != self.exact_dtype or x.dim() < 2 or torch.is_grad_enabled():
            return super().forward(x)
        # a call as wide as the last one is static storage written in place (or another sequence): multiplied whole,
        # with no look at the values (a static decode step reads nothing back to the host)
        same = _same_leading_rows(kept[0], x) if kept is not None and kept[0].shape != x.shape else 0
        if same == 0:
            out = super().forward(x)
        elif same == x.shape[-2]:
            out = kept[1].narrow(-2, 0, same).clone()
        else:
            out = torch.cat((kept[1].narrow(-2, 0, same), super().forward(x.narrow(-2, same, x.shape[-2] - same))),
                            dim=-2)
        self._kept = (x.clone(), out)
        return out.clone()  # callers own their output; the kept copy stays as computed


def _same_leading_rows(kept: torch.Tensor, x: torch.Tensor) -> int:
    """How many leading rows (dim -2) of x are bit-equal to kept's (same leading dims and width, else 0)."""
    if kept.dtype != x.dtype or kept.shape[:-2] != x.shape[:-2] or kept.shape[-1] != x.shape[-1]:
        return 0
    n = min(kept.shape[-2], x.shape[-2])
    if n == 0:
        return 0
    bits = torch.int16 if x.element_size() == 2 else torch.int32
    differs = (kept.narrow(-2, 0, n).view(bits) != x.narrow(-2, 0, n).view(bits)).reshape(-1, n, x.shape[-1])
    differs = differs.any(0).any(-1)
    first = torch.nonzero(differs)
    return int(first[0]) if len(first) else n


def _install_latent_rows(attentions: list) -> str:
    dtype = attentions[0].kv_b_proj.weight.dtype
    failed = next((i for i, a in enumerate(attentions) if not _rows_are_independent(a.kv_b_proj.weight)), None)
    if failed is not None:
        return (f"not installed: kv_b_proj of attention {failed} gives different bits for a row computed alone and "
                f"within all rows on this machine")
    for attention in attentions:
        attention.kv_b_proj.__class__ = LatentRowsLinear
        attention.kv_b_proj.exact_dtype = dtype
    return f"installed on {len(attentions)} attention layers ({dtype}): each row checked bit-equal alone and in all rows"


def _rows_are_independent(weight: torch.Tensor) -> bool:
    """Rows of x @ weight.T computed in one call, in a shorter one and one at a time agree bit for bit."""
    x = _spread((1, 1, 257, weight.shape[-1]), weight.dtype, seed=1)
    with torch.no_grad():
        whole = F.linear(x, weight)
        for cut in (1, 2, 31, 64, 255, 256):
            head, tail = F.linear(x[:, :, :cut], weight), F.linear(x[:, :, cut:], weight)
            if not (torch.equal(whole[:, :, :cut], head) and torch.equal(whole[:, :, cut:], tail)):
                return False
    return True


# -- bf16 linear layers through kernels/cpu_kernels.py ------------------------------------------------------------

# One input row through a weight smaller than this stays torch's call (the same bits): the kernel's call costs ~5 us
# more than torch's from Python, and at one row computes 256 x 512 in 14.2 us against torch's 20.5, 256 x 80 in 7.0
# against 4.8, 256 x 16 in 6.7 against 2.5 (AVX2 dispatch, one core of the dev machine's AMD EPYC, quiet): about
# where the two meet.
ONE_ROW_MIN_WEIGHT = 48 * 1024


class InOrderLinear(torch.nn.Linear):
    """A bias-free bf16 `nn.Linear` whose forward runs `kernels.cpu_kernels` (probed bit-equal to torch's call on this
    machine with this weight) while the weight is the one probed; anything else is torch's own forward."""

    _packed: torch.Tensor
    _packed_version: int
    _one_row: bool  # whether one input row comes here too (ONE_ROW_MIN_WEIGHT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # called ~100k times a model in a CPU run: plain attribute reads (the weight through _parameters, not
        # Module.__getattr__), cheapest test first
        if (x.dtype is torch.bfloat16 and x.is_cpu and not torch.is_grad_enabled()
                and (self._one_row or x.numel() != self.in_features)
                and self._parameters["weight"]._version == self._packed_version):
            return cpu_kernels.linear(x, self._packed, self.out_features)
        return super().forward(x)


class LatentRowsInOrderLinear(LatentRowsLinear, InOrderLinear):
    """`kv_b_proj` with both shortcuts: the rows it keeps, and the new rows through `InOrderLinear`."""


def drop_packed(model: torch.nn.Module) -> None:
    """Give a copy of the model whose weights left bf16 (the `fp32` path's twin) back its plain linear layers: its
    inputs are no longer bf16, so the packed bf16 weights (as large as the weights) would be held for nothing."""
    for module in model.modules():
        if isinstance(module, InOrderLinear) and module.weight.dtype != torch.bfloat16:
            del module._packed
            module.__class__ = LatentRowsLinear if isinstance(module, LatentRowsLinear) else torch.nn.Linear


def _install_linear(linears: list) -> str:
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "not installed: oneDNN has bf16 kernels on this CPU (torch's bf16 linear is oneDNN's, in its order)"
    lib = cpu_kernels.library()
    if isinstance(lib, str):
        return f"not installed: {lib}"
    chosen, refused = [], {}
    for linear in linears:
        why = cpu_kernels.supports(linear.weight)
        if why is None:
            packed = cpu_kernels.pack(linear.weight)
            why = _linear_differs(linear.weight, packed)
            if why is None:
                chosen.append((linear, packed))
                continue
        refused.setdefault(why, 0)
        refused[why] += 1
    for linear, packed in chosen:
        linear._packed, linear._packed_version = packed, linear.weight._version
        linear._one_row = linear.weight.numel() >= ONE_ROW_MIN_WEIGHT
        linear.__class__ = LatentRowsInOrderLinear if isinstance(linear, LatentRowsLinear) else InOrderLinear
    note = "; ".join(f"{count} kept torch's: {why}" for why, count in refused.items())
    if not chosen:
        return f"not installed: {note}"
    return (f"installed on {len(chosen)} of {len(linears)} bias-free bf16 linear layers: each bit-equal to torch's "
            f"call on this machine for 1-67 rows over 24 binades, NaN and inf" + (f" ({note})" if note else ""))


def _linear_differs(weight: torch.Tensor, packed: torch.Tensor) -> str | None:
    """None where `kernels.cpu_kernels` gives torch's bits for this weight on inputs of 1, 2, 3, 4, 5 and 67 rows
    (every row-block remainder of the C kernel, spread values, a NaN and an inf), else what differed."""
    k, n = weight.shape[1], weight.shape[0]
    with torch.no_grad():
        for rows in (1, 2, 3, 4, 5, 67):
            x = _spread((1, rows, k), torch.bfloat16, seed=rows)
            if rows == 67:
                x[0, 3, 5], x[0, 9, 0] = float("nan"), float("inf")
            want, got = F.linear(x, weight), cpu_kernels.linear(x, packed, n)
            if not torch.equal(want.view(torch.int16), got.view(torch.int16)):
                return f"the in-order kernel's bits differ from torch's for a [{rows}, {k}] x [{k}, {n}] product"
    return None


# -- depthwise conv1d in bf16 as float32, rounded ------------------------------------------------------------------

class _ExactConvFunctional(types.ModuleType):
    """A modeling module's `F`: `torch.nn.functional` with depthwise bf16 `conv1d` computed in float32 and
    rounded, for the tap counts `install` checked bit-exact. Every other name is torch's own."""

    def __init__(self, taps: frozenset[int]):
        super().__init__("torch.nn.functional (harness: exact depthwise bf16 conv1d in float32)")
        self._taps = taps

    def __getattr__(self, name):
        return getattr(F, name)

    def conv1d(self, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if (bias is None and input.dtype == weight.dtype == torch.bfloat16 and input.device.type == "cpu"
                and stride == 1 and dilation == 1 and weight.dim() == 3 and weight.shape[1] == 1
                and groups == weight.shape[0] and weight.shape[-1] in self._taps and not torch.is_grad_enabled()):
            return F.conv1d(input.float(), weight.float(), None, 1, padding, 1, groups).to(torch.bfloat16)
        return F.conv1d(input, weight, bias, stride, padding, dilation, groups)


def _install_conv(module, convs: list) -> str:
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "not installed: oneDNN has bf16 kernels on this CPU (its bf16 conv1d is the faster)"
    taps = frozenset(int(c.weight.shape[-1]) for c in convs)
    exact = _ExactConvFunctional(taps)
    for conv in convs:
        weight = conv.weight.detach().to(torch.bfloat16)
        for length, padding in ((weight.shape[-1] + 1, 0), (37, weight.shape[-1] - 1), (300, weight.shape[-1] - 1)):
            x = _spread((1, weight.shape[0], length), torch.bfloat16, seed=length)
            with torch.no_grad():
                want = F.conv1d(x, weight, None, 1, padding, 1, weight.shape[0])
                got = exact.conv1d(x, weight, None, 1, padding, 1, weight.shape[0])
            if not torch.equal(want, got):
                return (f"not installed: float32 conv1d rounded to bf16 differs from torch's bf16 conv1d on this "
                        f"machine (weight {tuple(weight.shape)}, {length} positions)")
    module.F = exact
    return (f"installed in {module.__name__} (taps {sorted(taps)}): bit-equal to torch's bf16 conv1d on this "
            f"machine, which has no oneDNN bf16 kernels")


def _spread(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over 2^-12..2^12 (normal mantissas, uniform binades): sums of their products round in float32,
    so a different summation order shows up as different bits."""
    generator = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-12, 13, shape, generator=generator)
    return (torch.randn(shape, generator=generator) * scale).to(dtype)
