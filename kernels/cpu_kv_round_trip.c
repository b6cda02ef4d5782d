/* The FP8 KV cache's write on the CPU in one pass: x (bf16) -> fp8(x / s) -> back to bf16, and its statistics.
 *
 * The same arithmetic as `kernels/reference.py` (`quantize`, `dequantize`) and the harness's write statistics
 * (`harness/kv_paths/cache.py`, `KVWriteStats.count`), element by element, each step one IEEE float32 operation:
 *   scaled = x / s; saturating: NaN stays, else clamped to +-max; not saturating: e4m3 |scaled| > 464 -> NaN,
 *   e5m2 |scaled| >= 61440 -> +-inf; the fp8 value is scaled rounded to the format's grid (nearest, ties to even);
 *   read back = bf16(fp8 value * s) (nearest even; a NaN as 0xffff, the bits torch 2.13 gives, probed);
 *   ratio = |x / s| / max; clipped: ratio > 1; nonfinite: the read-back value is not finite; amax: the largest
 *   ratio, NaN and inf counted as 0.
 * Nothing vectorised: the writes it serves are one token of one sequence (a few hundred values); its gain is one
 * call instead of ~25 small tensor ops. Whether its bits are torch's is checked against torch on every bf16 input
 * for each scale before a layer uses it (`harness/kv_paths/cache.py`).
 *
 * x [outer, heads, inner] bf16 contiguous (outer = batch, inner = tokens x head dim), scales [heads] or [1] float32.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t bf16_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0xffff; /* NaN: what torch's read back of an fp8 NaN gives */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* v rounded to the grid of a float with `mantissa` bits and smallest normal exponent `emin` (subnormals below):
 * nearest, ties to even. Finite v within the format's range (the caller clamps or maps overflow first). */
static inline float to_grid(float v, int mantissa, int emin) {
    if (v == 0.0f || !isfinite(v)) return v;
    int exponent;
    frexpf(v, &exponent);               /* |v| in [2^(exponent-1), 2^exponent) */
    int e = exponent - 1;
    if (e < emin) e = emin;             /* subnormal: the smallest normal's spacing */
    const int shift = mantissa - e;     /* the grid's step is 2^-shift */
    return ldexpf(nearbyintf(ldexpf(v, shift)), -shift);  /* both scalings exact; nearbyint ties to even */
}

int fp8h_kv_round_trip(const uint16_t *x, int64_t outer, int64_t heads, int64_t inner, const float *scales,
                       int64_t scale_count, int e5m2, int saturate, uint16_t *read_back, int64_t *clipped,
                       int64_t *nonfinite, float *amax, float *ratios) {
    const float max = e5m2 ? 57344.0f : 448.0f;
    const int mantissa = e5m2 ? 2 : 3, emin = e5m2 ? -14 : -6;
    int64_t clip = 0, bad = 0;
    float largest = 0.0f;
    for (int64_t o = 0; o < outer; o++)
        for (int64_t h = 0; h < heads; h++) {
            const float s = scales[scale_count == 1 ? 0 : h];
            const int64_t base = (o * heads + h) * inner;
            for (int64_t i = 0; i < inner; i++) {
                const float scaled = from_bf16(x[base + i]) / s;
                float q = scaled;
                if (saturate) {
                    if (!isnan(q)) q = q > max ? max : (q < -max ? -max : q);
                } else if (!e5m2) {
                    if (fabsf(q) > 464.0f) q = copysignf(NAN, q);
                } else if (fabsf(q) >= 61440.0f) {
                    q = copysignf(INFINITY, q);
                }
                const float back = to_grid(q, mantissa, emin) * s;
                const uint16_t stored = bf16_of(back);
                read_back[base + i] = stored;
                const float ratio = fabsf(scaled) / max;
                if (ratios != NULL) ratios[base + i] = ratio;
                if (ratio > 1.0f) clip++;
                if (!isfinite(from_bf16(stored))) bad++;
                if (isfinite(ratio) && ratio > largest) largest = ratio;
            }
        }
    *clipped = clip;
    *nonfinite = bad;
    *amax = largest;
    return 0;
}
