"""The yardstick's twin: its declared cache numerics written again outside the engine, so that a fault in the
engine cannot move it.

Every FP8 path of a run, the yardstick included, stores through the same engine code: `QuantizedKVLayer`'s
round trip (torch, the CPU's C write, the fused Triton write), the calibrated scales, the paged copy and the
decode kernels. A fault there (a scale not delivered at read, a layout refactor, a wrong calibration) hits every
path at once, and a path judged as a multiple of the yardstick then reads "1x the yardstick" however broken both
are (issue 40). The twin is what such a fault cannot move: the yardstick's element format, granularity and scale
source (default 1.0, calibrated amax over the same calibration chats, or per token) computed here, in a few lines
of torch that share nothing with the engine's write, scales or kernels: each layer observes the amax of what it
is given (the calibration pass) and, once it holds scales, stores x -> cast(clamp(x / s)) x s with torch's own
round-to-nearest-even float8 cast. Healthy, the twin computes the yardstick's very numbers (CPU: bit for bit), so
the yardstick's pooled KL over its twin's is 1; `harness.analysis.verdicts.yardstick_twin_reasons` fails the run
when it is not.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

# largest finite value and the torch dtype of each element format the twin emulates
ELEMENT = {"e4m3": (448.0, torch.float8_e4m3fn), "e5m2": (57344.0, torch.float8_e5m2)}
GRANULARITIES = ("per_tensor", "per_head", "per_token")
SCALE_SOURCES = ("default", "calibrated", "dynamic")  # what the twin can compute without the engine
MIN_SCALE = 1e-12  # an all-zero tensor's scale: x / s stays finite and reads back zeros


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str, saturate: bool = True) -> torch.Tensor:
    """x [batch, heads, tokens, dim] through `fmt` with `scale` ([] per tensor, [heads, 1, 1] per head,
    [batch, heads, tokens, 1] per token), read back in x's dtype: codes = torch's round-to-nearest-even cast of
    x / scale (clamped to the largest finite value when saturating), value = codes x scale in float32."""
    largest, dtype = ELEMENT[fmt]
    scaled = x.float() / scale
    if saturate:
        scaled = scaled.clamp(-largest, largest)
    return (scaled.to(dtype).float() * scale).to(x.dtype)


def scale_of(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """amax / the largest finite value, divided elementwise (IEEE division on every device), at least MIN_SCALE."""
    amax = amax.float()
    return (amax / torch.full_like(amax, ELEMENT[fmt][0])).clamp_min(MIN_SCALE)


def token_scale(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """One scale per token and head: the amax over the last dim, as `scale_of`."""
    return scale_of(x.float().abs().amax(dim=-1, keepdim=True), fmt)


class EmulatedKVLayer(DynamicLayer):
    """A `DynamicLayer` that records the per-head amax of what it is given and, once `scales` are set (or per
    token), stores the twin's fake-quantised K and V (MLA: the latent and its RoPE part, as the engine's cache
    holds them), attending over them as the reference's layer would."""

    def __init__(self, fmt: str, granularity: str, saturate: bool, scales: tuple | None):
        super().__init__()
        if fmt not in ELEMENT or granularity not in GRANULARITIES:
            raise ValueError(f"the twin emulates {', '.join(ELEMENT)} x {', '.join(GRANULARITIES)}; got {fmt!r}, "
                             f"{granularity!r}")
        self.fmt, self.granularity, self.saturate = fmt, granularity, saturate
        self.scales = scales  # (k_scale, v_scale): [] or [heads] float32 tensors; None: observe only
        self.k_amax: torch.Tensor | None = None  # [heads] float32, running over every update
        self.v_amax: torch.Tensor | None = None
        self.static = None  # StaticColumns (harness.kv_paths.cache.make_static): storage written in place

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # Observing (no static scales: the twin's calibration pass, or per-token scales) records the running amax on
        # the device. Static scales are moved to the device once, at the first (eager) write: a decode step that
        # copies from host memory or syncs is refused by a CUDA graph capture (session 19: every model's graph
        # decode fell back to eager for the twin)
        if self.scales is None or self.granularity == "per_token":
            self.k_amax = _running_amax(self.k_amax, key_states)
            self.v_amax = _running_amax(self.v_amax, value_states)
        elif self.scales[0].device != key_states.device or self.scales[1].device != key_states.device:
            self.scales = tuple(s.to(device=key_states.device, dtype=torch.float32) for s in self.scales)
        if self.granularity == "per_token":
            keys = fake_quantize(key_states, token_scale(key_states, self.fmt), self.fmt, self.saturate)
            values = fake_quantize(value_states, token_scale(value_states, self.fmt), self.fmt, self.saturate)
        elif self.scales is not None:
            keys = fake_quantize(key_states, self._shaped(self.scales[0], key_states), self.fmt, self.saturate)
            values = fake_quantize(value_states, self._shaped(self.scales[1], value_states), self.fmt, self.saturate)
        else:
            keys, values = key_states, value_states
        return self._store(keys, values)

    def _shaped(self, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        scale = scale.to(device=x.device, dtype=torch.float32)
        return scale.view(-1, 1, 1) if scale.dim() == 1 else scale

    def _store(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the same storage plumbing as cache.QuantizedKVLayer._store, written here on purpose: the twin imports
        # nothing of the engine's cache module (which imports this one), so a fault there cannot reach it
        if self.static is not None:
            return self.static.write(self, keys, values)
        return DynamicLayer.update(self, keys, values)

    def get_seq_length(self) -> int:
        return self.static.length if self.static is not None else super().get_seq_length()


def _running_amax(current: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    amax = x.detach().float().abs().amax(dim=(0, 2, 3))  # [batch, heads, tokens, dim] -> [heads], on x's device
    return amax if current is None else torch.maximum(current, amax)


def twin_scales(observed: dict[int, tuple[torch.Tensor, torch.Tensor]], fmt: str, granularity: str, source: str,
                one_per_latent: bool) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (k_scale, v_scale)} from the twin's own calibration pass ({layer: (k amax [heads], v amax)}):
    amax / the largest finite value, the max over heads per tensor, 1.0 for the `default` source; an MLA model's
    latent cache keeps one scale for the latent and its RoPE part (as engines store them in one row)."""
    scales = {}
    for layer, (k_amax, v_amax) in observed.items():
        if source == "default":
            k = v = torch.tensor(1.0)
        else:
            k, v = scale_of(k_amax, fmt), scale_of(v_amax, fmt)
            if granularity == "per_tensor":
                k, v = k.max(), v.max()
            if one_per_latent:
                k = v = torch.maximum(k.max(), v.max())
        scales[layer] = (k, v)
    return scales
