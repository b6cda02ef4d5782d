/* y = x @ w.T in bf16 on an x86 CPU with AVX2 + FMA, summing in the order torch's own bf16 fallback sums.
 *
 * Where oneDNN has no bf16 kernels (AVX2 without AVX-512 BF16), torch computes a bf16 linear as one dot product per
 * output with float32 arithmetic: 8 registers of 8 float lanes take 64 consecutive products of the reduction, each
 * lane adding its product to its running sum (a fused multiply-add, exact here: the product of two bf16 numbers
 * is exact in float32) chunk after chunk; then the registers are added pairwise (r + r+4, then r + r+2, then r + r+1),
 * then the lanes of the last one (l + l+4, l + l+2, l + l+1), and the float32 sum is rounded to bf16 (nearest even).
 * This file sums the same numbers in the same order, with the vector lanes running over 8 outputs instead of over
 * the reduction, so one weight load serves up to 4 input rows. It assumes nothing about torch: the Python side
 * (`kernels/cpu_kernels.py`) installs it only where it gave torch's bits on probes (`harness/replay/cpu_exact.py`).
 *
 * Layout: x [m, k] bf16 rows; packed weight [ceil(n / 8), k, 8] bf16 (8 outputs' weights side by side, zero-padded);
 * out [m, n] bf16. k must be a multiple of 64 (the caller checks).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8
#define REGISTERS 8
#define CHUNK (LANES * REGISTERS)
#define ROW_BLOCK 4

static inline __m256 bf16x8(const uint16_t *p) {
    __m128i half = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, as torch writes it */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* The cpu has the instructions this file is compiled for (checked before the first call). */
int fp8h_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* ROWS rows x one block of 8 outputs: the 64 lane sums of each (row, output), kept in registers while they run
 * over the chunks, GROUP lanes at a time (ROWS x GROUP <= 8 independent accumulators); both constants. */
#define DEFINE_BLOCK_SUMS(ROWS, GROUP)                                                                            \
    static void block_sums_##ROWS(const float *xf, int64_t k, int64_t chunks, const uint16_t *w,                \
                                  __m256 part[ROW_BLOCK][CHUNK]) {                                               \
        for (int pos = 0; pos < CHUNK; pos += GROUP) {                                                           \
            __m256 acc[ROWS][GROUP];                                                                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                              \
                _Pragma("GCC unroll 8") for (int g = 0; g < GROUP; g++) acc[r][g] = _mm256_setzero_ps();        \
            for (int64_t c = 0; c < chunks; c++) {                                                               \
                const int64_t j = c * CHUNK + pos;                                                               \
                _Pragma("GCC unroll 8") for (int g = 0; g < GROUP; g++) {                                       \
                    const __m256 weight = bf16x8(w + (j + g) * LANES);                                           \
                    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                      \
                        acc[r][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(&xf[r * k + j + g]), weight, acc[r][g]); \
                }                                                                                                \
            }                                                                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                              \
                _Pragma("GCC unroll 8") for (int g = 0; g < GROUP; g++) part[r][pos + g] = acc[r][g];           \
        }                                                                                                        \
    }
DEFINE_BLOCK_SUMS(1, 8)
DEFINE_BLOCK_SUMS(2, 4)
DEFINE_BLOCK_SUMS(3, 2)
DEFINE_BLOCK_SUMS(4, 2)

int fp8h_bf16_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n, uint16_t *out) {
    if (k <= 0 || k % CHUNK != 0) return 1;
    float *xf = aligned_alloc(32, (size_t)(ROW_BLOCK * k) * sizeof(float));
    if (xf == NULL) return 2;
    const int64_t chunks = k / CHUNK, blocks = (n + LANES - 1) / LANES;
    __m256 part[ROW_BLOCK][CHUNK];
    for (int64_t i0 = 0; i0 < m; i0 += ROW_BLOCK) {
        const int rows = (int)(m - i0 < ROW_BLOCK ? m - i0 : ROW_BLOCK);
        for (int r = 0; r < rows; r++)
            for (int64_t j = 0; j < k; j++) {
                uint32_t bits = (uint32_t)x[(i0 + r) * k + j] << 16;
                memcpy(&xf[r * k + j], &bits, sizeof bits);
            }
        for (int64_t block = 0; block < blocks; block++) {
            const uint16_t *w = packed + block * k * LANES;
            switch (rows) {
                case 4: block_sums_4(xf, k, chunks, w, part); break;
                case 3: block_sums_3(xf, k, chunks, w, part); break;
                case 2: block_sums_2(xf, k, chunks, w, part); break;
                default: block_sums_1(xf, k, chunks, w, part); break;
            }
            for (int r = 0; r < rows; r++) {
                __m256 *p = part[r];
                for (int offset = REGISTERS / 2; offset > 0; offset /= 2) /* registers, pairwise */
                    for (int reg = 0; reg < offset; reg++)
                        for (int lane = 0; lane < LANES; lane++)
                            p[reg * LANES + lane] = _mm256_add_ps(p[reg * LANES + lane],
                                                                  p[(reg + offset) * LANES + lane]);
                for (int offset = LANES / 2; offset > 0; offset /= 2) /* the last register's lanes */
                    for (int lane = 0; lane < offset; lane++)
                        p[lane] = _mm256_add_ps(p[lane], p[lane + offset]);
                float sums[LANES];
                _mm256_storeu_ps(sums, p[0]);
                const int64_t first = block * LANES;
                for (int t = 0; t < LANES && first + t < n; t++) out[(i0 + r) * n + first + t] = to_bf16(sums[t]);
            }
        }
    }
    free(xf);
    return 0;
}
