// GQA decode over a paged block-scaled cache, split-KV: the CUDA kernel of kernels/decode_attention_block_scaled.py's
// impl="cuda" entries (compiled at first use by NVRTC, kernels/nvrtc.py; sm_89 and later). One source for every
// layout of kernels/reference.py's "Block-scaled caches":
//   ELEMENT 0 e2m1 (two a byte, the even index in the low nibble), 1 e4m3, 2 int8, 3 int4 (two's-complement nibbles);
//   SCALE 0 e4m3 per 16 values (NVFP4), 1 e8m0 per BLOCK (16 or 32) values (MX), 2 fp32 per token and KV head
// (the numbering of the Triton kernel's ELEMENT and BLOCK_SCALE, kernels/decode_attention_block_scaled.py); and the
// plain FP8 caches of kernels/decode_attention.py: ELEMENT 1 or 4 (e5m2) under SCALE 3 (no block scales: only the
// static per-tensor or per-KV-head scale every layout takes).
// Defines: ELEMENT, SCALE, BLOCK, HEAD_DIM (64, 128 or 256), PAGE (a multiple of 16), CS and SS (bytes from one
// slot's codes and scales to the next's), NW warps, CTAS blocks per SM (launch bounds), PREFETCH tiles loaded ahead
// (1 or 2), Q_BF16, G16 (1: 9-16 query heads per KV head, else up to 8).
//
// Same definition and partial layout as the Triton kernel (kernels/decode_attention_block_scaled.py): q rounded to
// fp16, the tiles' values in fp16, scores and accumulation in fp32, online softmax in base 2 with P rounded to fp16
// for P.V; out = v_scale x acc / l and lse2 = m + log2(l) per split, the splits merged by
// kernels/decode_attention.merge_splits. Tokens past the sequence's end add nothing (their scores are -inf and their
// V codes and scales are zeroed, so a NaN in a stale slot never meets P = 0).
//
// Why a hand-written kernel (kernels/BENCHMARKS.md, session 16): the Triton kernel is issue-bound, not memory-bound,
// its tiles widened in the load layout and moved into the MMA operand layouts by register shuffles. Here every value
// is widened in registers straight into the mma.sync.m16n8k16 (f16 in, f32 accumulate) fragment that uses it, the
// query stays in registers, and each warp walks its own 16-token tiles (no barrier in the loop):
// - Q . K^T: A = Q (16 rows, one per query head; rows past the group are zeros), B = K^T (n = 8 tokens). Rows
//   g + 8 (heads 8-15) only where G16; each lane then keeps a second softmax row and a second accumulator. A lane
//   (g = lane / 4, q = lane % 4) reads one run of codes of tokens g and g + 8 (a quarter of their head): the MMA sums
//   over k in any order, so the f16x2 pairs the widening yields are the k pairs of the B fragment as they come, and
//   Q's fragment is gathered in the same order once, before the loop (`pair_elements`).
// - P . V: the output transposed, A = V^T (m = 16 head dims, k = 16 tokens), B = P^T (k = 16 tokens, n = 8 query
//   heads): B is exactly the Q . K^T accumulator of the same lane (rows g; G16: rows g + 8 in a second MMA into a
//   second accumulator, the same A), so P never crosses lanes. A lane reads one
//   run of codes of each of 4 tokens (an eighth of their head) and interleaves two tokens' code bytes with a byte
//   permute (prmt) before widening, so each pair holds one head dim of two tokens; the head dims land in an order the
//   output store puts back (`v_dim`).
// - Widening (exact): e2m1 (s e1 e0 m) becomes the e4m3 byte s 00e1e0 m00 (the value x 2^-6) in three or four
//   integer ops a word, then cvt.rn.f16x2.e4m3x2 as e4m3 codes; int4 and int8 by the fp16 magic number (n placed in
//   1024 + n', the offset subtracted).
// - Scales. e4m3 blocks (NVFP4): the block scale multiplies each f16x2 pair (element x scale: at most 6 significant
//   bits, exact), 2^6 folded into the softmax and output scales. e8m0 blocks, as the Triton kernel: with top_j the
//   token's largest exponent (at least 1), pairs are multiplied by 2^(e_jb - top_j) (2^(e_jb - top_j + 6) for e2m1)
//   in fp16 (exact to 2^-24 of the token's largest), and 2^(top_j - 127) is a per-token factor. Per-token factors
//   (fp32 per token-head scales, e8m0's 2^top) multiply the score (K) and go into P's column over the largest V
//   factor so far, so P stays <= 1, the accumulator kept in that largest's units (V). e8m0's factors are kept as
//   exponents: the multipliers and ratios are built by integer ops and selects, never a branch or a division
//   (kernels/BENCHMARKS.md, session 26: the branches and divisions had cost MXFP8 0.25 against 0.16 ms).
// - The accumulator is rescaled only when some row's running maximum (or the largest V factor) moved (a warp vote):
//   multiplying by 1 is exact, so this skips work without changing a bit.
// - The next tiles' codes and scales are loaded into registers while this one is computed (PREFETCH buffers taken in
//   turn); at the end the warps of a block merge their (m, l, acc) through shared memory and write one partial per
//   split, or, where the launch has one split and no sinks (`direct`), the output and lse themselves: no merge launch.

#if ELEMENT == 4
#define FMT_E5M2 1   // widen2 / widen2_hi convert e5m2 pairs
#endif
#include "mla_fp8_common.cuh"

#define D HEAD_DIM
#define NT (NW * 32)
#ifndef G16
#define G16 0   // 1: 9-16 query heads a KV head (rows g + 8 of Q . K^T, a second P . V into acc_hi)
#endif
#define GROUP_MAX (G16 ? 16 : 8)
#ifndef PREFETCH
#define PREFETCH 1
#endif
#ifndef BLOCK
#define BLOCK 16
#endif

constexpr int BITS = (ELEMENT == 0 || ELEMENT == 3) ? 4 : 8;
constexpr bool FP8 = ELEMENT == 1 || ELEMENT == 4;   // e4m3 or e5m2 codes: one cvt a pair
constexpr int EPW = 32 / BITS;              // elements a 32-bit code word holds
constexpr int HPW = EPW / 2;                // f16x2 pairs a K word widens to
constexpr int KW = D * BITS / 32 / 4;       // K code words a lane reads per token (a quarter: D / 4 elements)
constexpr int VW = D * BITS / 64 / 4;       // V code words (an eighth: D / 8 elements)
constexpr int MTILES = D / 16;              // m16 tiles of head dims in P . V (and k16 steps in Q . K^T)
constexpr int KSB = D / 64;                 // SCALE 0: K scale bytes of a lane's quarter
constexpr int VSB = D >= 256 ? 2 : 1;       // SCALE 0: V scale bytes of a lane's eighth
constexpr int SR = D / BLOCK;               // SCALE 2: bytes of a token's scale row
constexpr int SRW = (SR + 3) / 4;
constexpr float WIDEN_SCALE = (ELEMENT == 0 && SCALE == 0) ? 64.f : 1.f;   // e2m1 widened x 2^-6, NVFP4's fold
constexpr int E8M0_OFFSET = ELEMENT == 0 ? 6 : 0;                          // ... and e8m0's, in the multiplier
static_assert(ELEMENT >= 0 && ELEMENT <= 4 && SCALE >= 0 && SCALE <= 3, "unknown ELEMENT or SCALE");
static_assert(ELEMENT != 4 || SCALE == 3, "e5m2 codes come from the plain FP8 caches only");
static_assert(SCALE != 0 || BLOCK == 16, "e4m3 block scales are per 16 values");
static_assert(KW >= 1 && VW >= 1, "head size too small for this element");

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ u32 max_u16x2(u32 a, u32 b) {
  u32 r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
#endif

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
  u32 r;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}


// Two int4 codes (nibbles at bits 0-3 and 16-19) -> f16x2: each in 1024 + (n ^ 8), less 1032.
__device__ __forceinline__ u32 int4_pair(u32 x) {
  u32 t;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x64086408, 0x6A;" : "=r"(t) : "r"(x));   // (x & 0x000F000F) ^ 0x64086408
  return hsub2(t, 0x64086408u);
}

// Two int8 codes (bytes 0 and 1, or 2 and 3 when HIGH) -> f16x2: each in 1024 + (c ^ 128), less 1152.
template <bool HIGH> __device__ __forceinline__ u32 int8_pair(u32 x) {
  return hsub2(prmt(x ^ 0x80808080u, 0x64646464u, HIGH ? 0x4342 : 0x4140), 0x64806480u);
}

// One code word -> its HPW f16x2 pairs (K), in the order pair_elements says.
__device__ __forceinline__ void widen_word(u32 c, u32* h) {
  if constexpr (ELEMENT == 0) {
    const u32 lo = e4m3_of_low(c), hi = e4m3_of_high(c);
    h[0] = widen2(lo); h[1] = widen2_hi(lo); h[2] = widen2(hi); h[3] = widen2_hi(hi);
  } else if constexpr (ELEMENT == 3) {
    h[0] = int4_pair(c); h[1] = int4_pair(c >> 4); h[2] = int4_pair(c >> 8); h[3] = int4_pair(c >> 12);
  } else if constexpr (FP8) {
    h[0] = widen2(c); h[1] = widen2_hi(c);
  } else {
    h[0] = int8_pair<false>(c); h[1] = int8_pair<true>(c);
  }
}

// The elements (lo, hi), within a lane's quarter, of K pair j (word j / HPW).
__device__ __forceinline__ void pair_elements(int j, int& lo, int& hi) {
  const int w = j / HPW, i = j % HPW;
  if constexpr (ELEMENT == 0) { lo = 8 * w + ((i & 1) << 2) + (i >> 1); hi = lo + 2; }
  else if constexpr (ELEMENT == 3) { lo = 8 * w + i; hi = lo + 4; }
  else { lo = 4 * w + 2 * i; hi = lo + 1; }
}

// Code word w of tokens a and b -> EPW f16x2 pairs (a's element low, b's high), head dims v_dim(jj) of the word.
__device__ __forceinline__ void widen_pair(u32 a, u32 b, u32* h) {
  if constexpr (ELEMENT == 0) {
    const u32 r0 = prmt(a, b, 0x5140), r1 = prmt(a, b, 0x7362);   // bytes a0 b0 a1 b1, a2 b2 a3 b3
    const u32 l0 = e4m3_of_low(r0), l1 = e4m3_of_low(r1), h0 = e4m3_of_high(r0), h1 = e4m3_of_high(r1);
    h[0] = widen2(l0); h[1] = widen2_hi(l0); h[2] = widen2(l1); h[3] = widen2_hi(l1);
    h[4] = widen2(h0); h[5] = widen2_hi(h0); h[6] = widen2(h1); h[7] = widen2_hi(h1);
  } else if constexpr (ELEMENT == 3) {
    const u32 r0 = prmt(a, b, 0x5410), r1 = prmt(a, b, 0x7632);   // a0 a1 b0 b1, a2 a3 b2 b3
    h[0] = int4_pair(r0); h[1] = int4_pair(r0 >> 4); h[2] = int4_pair(r0 >> 8); h[3] = int4_pair(r0 >> 12);
    h[4] = int4_pair(r1); h[5] = int4_pair(r1 >> 4); h[6] = int4_pair(r1 >> 8); h[7] = int4_pair(r1 >> 12);
  } else {
    const u32 r0 = prmt(a, b, 0x5140), r1 = prmt(a, b, 0x7362);
    if constexpr (FP8) {
      h[0] = widen2(r0); h[1] = widen2_hi(r0); h[2] = widen2(r1); h[3] = widen2_hi(r1);
    } else {
      h[0] = int8_pair<false>(r0); h[1] = int8_pair<true>(r0); h[2] = int8_pair<false>(r1);
      h[3] = int8_pair<true>(r1);
    }
  }
}

__device__ __forceinline__ int v_dim(int jj) {   // head dim, within its word, of V pair jj
  return ELEMENT == 0 ? ((jj & 3) << 1) + (jj >> 2) : jj;
}

template <int N> struct Words { u32 w[N]; };

template <int BYTES> __device__ __forceinline__ Words<(BYTES + 3) / 4> load_run(const u8* p) {   // BYTES-aligned
  Words<(BYTES + 3) / 4> r;
  if constexpr (BYTES == 1) r.w[0] = *p;
  else if constexpr (BYTES == 2) r.w[0] = *(const u16*)p;
  else if constexpr (BYTES == 4) r.w[0] = *(const u32*)p;
  else if constexpr (BYTES == 8) { const uint2 x = *(const uint2*)p; r.w[0] = x.x; r.w[1] = x.y; }
  else {
#pragma unroll
    for (int i = 0; i < BYTES / 4; i += 4) {
      const uint4 x = *(const uint4*)(p + 4 * i);
      r.w[i] = x.x; r.w[i + 1] = x.y; r.w[i + 2] = x.z; r.w[i + 3] = x.w;
    }
  }
  return r;
}

// e8m0 rows: the largest exponent byte (at least 1), one byte, 2^(e - top + offset) as fp16 bits (RTNE of the fp32
// power: 0 below 2^-24; 255 is NaN) and 2^(top - 127) as fp32 (255: inf, then NaN downstream, as in Triton).
__device__ __forceinline__ int row_top(const Words<SRW>& r) {
#if __CUDA_ARCH__ >= 900   // bytes as u16 lanes, max.u16x2 (sm_90): ~6 ops a row against ~18 for __vmaxu4's emulation
  u32 m = max_u16x2(prmt(r.w[0], 0, 0x4240), prmt(r.w[0], 0, 0x4341));
#pragma unroll
  for (int i = 1; i < SRW; ++i) m = max_u16x2(m, max_u16x2(prmt(r.w[i], 0, 0x4240), prmt(r.w[i], 0, 0x4341)));
  return max((int)max(m & 0xFFFFu, m >> 16), 1);
#else
  u32 m = r.w[0];
#pragma unroll
  for (int i = 1; i < SRW; ++i) m = __vmaxu4(m, r.w[i]);
  m = __vmaxu4(m, m >> 16);
  m = __vmaxu4(m, m >> 8);
  return max((int)(m & 0xFF), 1);
#endif
}
__device__ __forceinline__ int row_byte(const Words<SRW>& r, int i) { return (r.w[i >> 2] >> (8 * (i & 3))) & 0xFF; }
__device__ __forceinline__ u32 pow2_f16(int e, int top) {   // selects, no branches (they cost 2x the time)
  const int k = e - top + E8M0_OFFSET;                          // <= E8M0_OFFSET: e <= top
  u32 normal, sub;
  asm("shl.b32 %0, %1, 10;" : "=r"(normal) : "r"(k + 15));
  asm("shl.b32 %0, 1, %1;" : "=r"(sub) : "r"(k + 24));          // PTX shl: a shift past 31 (k < -24) gives 0
  const u32 bits = k >= -14 ? normal : sub;
  return e == 255 ? 0x7E00u : bits;
}
__device__ __forceinline__ float factor_of(int top) { return __uint_as_float((u32)top << 23); }
// 2^k as fp32 (0 below 2^-126)
__device__ __forceinline__ float pow2_f32(int k) { return __uint_as_float((u32)max(k + 127, 0) << 23); }

// What a lane reads of one 16-token tile: K codes of tokens g and 8 + g (quarter q), V codes of tokens 2q, 2q + 1,
// 2q + 8, 2q + 9 (eighth g), and their scales: NVFP4's bytes (K: the quarter's blocks of tokens g, 8 + g; V: the
// eighth's block of the 4 V tokens), per token-head fp32 (K and V of tokens 2q, 2q + 1, 2q + 8, 2q + 9), or e8m0
// rows (K: tokens g, 8 + g; V: the 4 V tokens).
struct Tile {
  Words<KW> k[2];
  Words<VW> v[4];
#if SCALE == 0
  u32 ks[2], vs[4];
#elif SCALE == 2
  float ks[4], vs[4];
#else
  Words<SRW> ks[2], vs[4];
#endif
};

__device__ __forceinline__ Tile load_tile(const u8* kp, const u8* vp, const u8* ksp, const u8* vsp) {
  Tile t;
#pragma unroll
  for (int i = 0; i < 2; ++i) t.k[i] = load_run<KW * 4>(kp + 8 * i * CS);
#pragma unroll
  for (int i = 0; i < 4; ++i) t.v[i] = load_run<VW * 4>(vp + ((i & 1) + 8 * (i >> 1)) * CS);
#if SCALE == 0
#pragma unroll
  for (int i = 0; i < 2; ++i) t.ks[i] = load_run<KSB>(ksp + 8 * i * SS).w[0];
#pragma unroll
  for (int i = 0; i < 4; ++i) t.vs[i] = load_run<VSB>(vsp + ((i & 1) + 8 * (i >> 1)) * SS).w[0];
#elif SCALE == 2
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    t.ks[i] = *(const float*)(ksp + ((i & 1) + 8 * (i >> 1)) * SS);
    t.vs[i] = *(const float*)(vsp + ((i & 1) + 8 * (i >> 1)) * SS);
  }
#else
#pragma unroll
  for (int i = 0; i < 2; ++i) t.ks[i] = load_run<SR>(ksp + 8 * i * SS);
#pragma unroll
  for (int i = 0; i < 4; ++i) t.vs[i] = load_run<SR>(vsp + ((i & 1) + 8 * (i >> 1)) * SS);
#endif
  return t;
}

extern "C" __global__ void __launch_bounds__(NT, CTAS) gqa_block_scaled_decode(
    const u16* __restrict__ q_ptr, const u8* __restrict__ k_codes, const u8* __restrict__ v_codes,
    const u8* __restrict__ k_scales, const u8* __restrict__ v_scales, const int* __restrict__ block_table,
    const int* __restrict__ seq_lens, const float* __restrict__ k_static, const float* __restrict__ v_static,
    float* __restrict__ part_out, float* __restrict__ part_lse, double sm_scale_log2, int tokens_per_split,
    int group, int k_static_stride, int v_static_stride, int has_static, int s_qb, int s_qh, int s_cb, int s_ch,
    int s_sb, int s_sh, int s_tb, int s_ob, int s_oh, int s_os, int s_eb, int s_eh, u16* __restrict__ out_ptr,
    float* __restrict__ lse_ptr, int direct, int s_xb, int s_xh, int s_lb) {
  __shared__ float sm_m[NW][GROUP_MAX], sm_l[NW][GROUP_MAX];
  __shared__ float sm_acc[NW][GROUP_MAX][D];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  const int kv_head = blockIdx.x, split = blockIdx.z;
  const i64 b = blockIdx.y;
  const int start = split * tokens_per_split;
  const int end = min(start + tokens_per_split, seq_lens[b]);
  const float ks_static = has_static ? k_static[kv_head * k_static_stride] : 1.f;
  const float vs_static = has_static ? v_static[kv_head * v_static_stride] : 1.f;
  const float qk_scale = (float)sm_scale_log2 * WIDEN_SCALE * ks_static;

  u32 qa[MTILES][2];   // Q's A fragments: rows g (rows g + 8, and rows past the group, are zeros unless G16)
#if G16
  u32 qh[MTILES][2];   // rows g + 8: heads 8-15
#endif
  {
    const u16* qrow = q_ptr + b * s_qb + (i64)(kv_head * group + g) * s_qh + q * (D / 4);
#pragma unroll
    for (int j = 0; j < 2 * MTILES; ++j) {
      int lo, hi;
      pair_elements(j, lo, hi);
      u32 pair = 0;
      if (g < group) pair = half2_of((u32)qrow[lo] | ((u32)qrow[hi] << 16));
      qa[j >> 1][j & 1] = pair;
#if G16
      pair = 0;
      if (g + 8 < group) pair = half2_of((u32)qrow[8 * s_qh + lo] | ((u32)qrow[8 * s_qh + hi] << 16));
      qh[j >> 1][j & 1] = pair;
#endif
    }
  }
#if G16
#define QH(mi, k) qh[mi][k]
#else
#define QH(mi, k) 0u
#endif

  float m = NEG_INF, l = 0.f, v_top = 0.f;   // v_top: the largest V factor so far (SCALE 2)
  int v_exp = 0;                             // SCALE 1: the largest V top so far (0: none yet)
  float acc[MTILES][4];
#pragma unroll
  for (int i = 0; i < MTILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#if G16
  float m_hi = NEG_INF, l_hi = 0.f;          // row g + 8's softmax, and heads 8 + 2q, 9 + 2q's accumulator
  float acc_hi[MTILES][4];
#pragma unroll
  for (int i = 0; i < MTILES; ++i) acc_hi[i][0] = acc_hi[i][1] = acc_hi[i][2] = acc_hi[i][3] = 0.f;
#endif

  const int* table = block_table + b * s_tb;
  const u8* k_lane = k_codes + (i64)kv_head * s_ch + g * CS + q * (KW * 4);
  const u8* v_lane = v_codes + (i64)kv_head * s_ch + 2 * q * CS + g * (VW * 4);
  const u8* ks_lane = k_scales + (i64)kv_head * s_sh +
                      (SCALE == 0 ? g * SS + q * KSB : SCALE == 2 ? 2 * q * SS : g * SS);
  const u8* vs_lane = v_scales + (i64)kv_head * s_sh + 2 * q * SS + (SCALE == 0 ? (g * D) / 128 : 0);
  auto tile_at = [&](int n0) -> Tile {   // tiles start at multiples of 16: at page size 16, at a page's first slot
    const i64 page = table[n0 / PAGE], slot = PAGE == 16 ? 0 : n0 % PAGE;
    return load_tile(k_lane + page * s_cb + slot * CS, v_lane + page * s_cb + slot * CS,
                     ks_lane + page * s_sb + slot * SS, vs_lane + page * s_sb + slot * SS);
  };

  auto step = [&](Tile& cur, const int n0) {
    // Q . K^T: s[i] = scores of tokens 8i + 2q, 8i + 2q + 1 for head g (rows g + 8 unused)
    float s[2][4];
#if SCALE == 1
    int top[2];
#endif
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#if SCALE == 0
      const u32 sc = widen2(cur.ks[i] | (KSB > 1 ? 0u : cur.ks[i] << 8));   // the quarter's block scales, f16
#elif SCALE == 1
      top[i] = row_top(cur.ks[i]);
#endif
#pragma unroll
      for (int w = 0; w < KW; ++w) {
        u32 h[HPW];
        widen_word(cur.k[i].w[w], h);
#if SCALE == 0
        const int blk = (w * EPW) / 16;   // of the quarter's KSB blocks
        const u32 two = blk < 2 ? sc : widen2_hi(cur.ks[i]);
        const u32 mul = (blk & 1) ? prmt(two, 0, 0x3232) : prmt(two, 0, 0x1010);
#pragma unroll
        for (int k = 0; k < HPW; ++k) h[k] = hmul2(h[k], mul);
#elif SCALE == 1
        const u32 mh = pow2_f16(row_byte(cur.ks[i], (q * (D / 4) + w * EPW) / BLOCK), top[i]);
#pragma unroll
        for (int k = 0; k < HPW; ++k) h[k] = hmul2(h[k], mh | (mh << 16));
#endif
#pragma unroll
        for (int k = 0; k < HPW; k += 2) {
          const int mi = (w * HPW + k) / 2;
          mma16816(s[i], qa[mi][0], QH(mi, 0), qa[mi][1], QH(mi, 1), h[k], h[k + 1]);
        }
      }
    }

    float f[4];   // each score's scale: tokens 2q, 2q + 1, 8 + 2q, 9 + 2q
#if SCALE == 2
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = cur.ks[i] * qk_scale;   // the Triton kernel's order
#elif SCALE == 1
    {   // the score fragment's tokens get their tops from the lanes that read them (g = 2q, 2q + 1)
      const int t[4] = {__shfl_sync(0xffffffffu, top[0], 8 * q), __shfl_sync(0xffffffffu, top[0], 8 * q + 4),
                        __shfl_sync(0xffffffffu, top[1], 8 * q), __shfl_sync(0xffffffffu, top[1], 8 * q + 4)};
#pragma unroll
      for (int i = 0; i < 4; ++i) f[i] = factor_of(t[i]) * qk_scale;
    }
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = qk_scale;
#endif
    const bool tail = n0 + 16 > end;
    // one row's online softmax over the tile: its scores (x, NEG_INF past the end) -> P in place, (m, l) updated,
    // the accumulator's factor returned
    auto softmax = [&](float* x, float& m_row, float& l_row) -> float {
      if (tail) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (n0 + 8 * (i >> 1) + 2 * q + (i & 1) >= end) x[i] = NEG_INF;
      }
      float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_row, mx);
      const float m_use = m_new == NEG_INF ? 0.f : m_new;
      const float alpha = ex2(m_row - m_use);
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = ex2(x[i] - m_use);
      l_row = l_row * alpha + ((x[0] + x[1]) + (x[2] + x[3]));
      m_row = m_new;
      return alpha;
    };
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = s[i >> 1][i & 1] * f[i];
    const float alpha = softmax(p, m, l);
#if G16
    float p_hi[4];   // row g + 8: the accumulator fragment's rows 2 and 3
#pragma unroll
    for (int i = 0; i < 4; ++i) p_hi[i] = s[i >> 1][2 + (i & 1)] * f[i];
    const float alpha_hi = softmax(p_hi, m_hi, l_hi);
#endif

    if (tail) {   // V of the tokens past the end: codes and scales zeroed (a stale NaN would survive P = 0)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (n0 + 2 * q + (i & 1) + 8 * (i >> 1) >= end) {
#pragma unroll
          for (int w = 0; w < VW; ++w) cur.v[i].w[w] = 0u;
#if SCALE == 1
#pragma unroll
          for (int w = 0; w < SRW; ++w) cur.vs[i].w[w] = 0u;
#elif SCALE != 3
          cur.vs[i] = 0;
#endif
        }
    }
    float v_ratio = 1.f;   // the accumulators' factor from a larger V factor (1: none, exact)
#if SCALE == 1   // factors 2^(top - 127) kept as exponents: their ratios are exact powers of two, no division
    int vtop[4];   // the V tokens' tops (rows past the end were zeroed: top 1, at most any real token's)
#pragma unroll
    for (int i = 0; i < 4; ++i) vtop[i] = row_top(cur.vs[i]);
    int vt = max(max(vtop[0], vtop[1]), max(vtop[2], vtop[3]));   // every quad holds the same 16 tokens
    vt = max(vt, __shfl_xor_sync(0xffffffffu, vt, 1));
    vt = max(vt, __shfl_xor_sync(0xffffffffu, vt, 2));
    const int v_new = max(v_exp, vt);
    if (v_exp != v_new) v_ratio = pow2_f32(v_exp - v_new);   // before the first tile the accumulator is 0
    v_exp = v_new;
    float vf[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) vf[i] = pow2_f32(vtop[i] - v_new);
#elif SCALE == 2
    float vf[4];   // the V tokens' factors (0 past the end)
#pragma unroll
    for (int i = 0; i < 4; ++i) vf[i] = cur.vs[i];
    float vt = fmaxf(fmaxf(vf[0], vf[1]), fmaxf(vf[2], vf[3]));   // every quad holds the same 16 tokens
    vt = fmaxf(vt, __shfl_xor_sync(0xffffffffu, vt, 1));
    vt = fmaxf(vt, __shfl_xor_sync(0xffffffffu, vt, 2));
    const float v_new = fmaxf(v_top, vt), v_unit = v_new > 0.f ? v_new : 1.f;
    if (v_top != v_new) v_ratio = v_top / v_unit;   // 0 before the first factor above 0, the accumulator still 0
    v_top = v_new;
#pragma unroll
    for (int i = 0; i < 4; ++i) vf[i] = vf[i] / v_unit;
#endif
#if SCALE == 1 || SCALE == 2
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] *= vf[i];
#if G16
#pragma unroll
    for (int i = 0; i < 4; ++i) p_hi[i] *= vf[i];
#endif
#endif
    const float rescale = alpha * v_ratio;
#if G16
    const float rescale_hi = alpha_hi * v_ratio;
    const bool moved = rescale != 1.f || rescale_hi != 1.f;
#else
    const bool moved = rescale != 1.f;
#endif
    if (__any_sync(0xffffffffu, moved)) {   // the accumulator's columns are heads 2q, 2q + 1 (acc_hi: 8 + those)
      const float a0 = __shfl_sync(0xffffffffu, rescale, 8 * q), a1 = __shfl_sync(0xffffffffu, rescale, 8 * q + 4);
#pragma unroll
      for (int i = 0; i < MTILES; ++i) {
        acc[i][0] *= a0; acc[i][1] *= a1; acc[i][2] *= a0; acc[i][3] *= a1;
      }
#if G16
      const float b0 = __shfl_sync(0xffffffffu, rescale_hi, 8 * q);
      const float b1 = __shfl_sync(0xffffffffu, rescale_hi, 8 * q + 4);
#pragma unroll
      for (int i = 0; i < MTILES; ++i) {
        acc_hi[i][0] *= b0; acc_hi[i][1] *= b1; acc_hi[i][2] *= b0; acc_hi[i][3] *= b1;
      }
#endif
    }
    const u32 pb0 = pack_half2(p[0], p[1]), pb1 = pack_half2(p[2], p[3]);
#if G16
    const u32 ph0 = pack_half2(p_hi[0], p_hi[1]), ph1 = pack_half2(p_hi[2], p_hi[3]);
#endif

    // P . V over token pairs (2q, 2q + 1) and (2q + 8, 2q + 9)
#if SCALE == 0
    u32 vsc[2][VSB];   // f16x2 scales (token a, token b) of each pair, per block of the eighth
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
      const u32 both = prmt(cur.vs[2 * pr], cur.vs[2 * pr + 1], 0x5140);   // a0 b0 a1 b1
      vsc[pr][0] = widen2(both);
      if (VSB > 1) vsc[pr][VSB - 1] = widen2_hi(both);
    }
#endif
#pragma unroll
    for (int w = 0; w < VW; ++w) {
      u32 h[2][EPW];
#pragma unroll
      for (int pr = 0; pr < 2; ++pr) {
        widen_pair(cur.v[2 * pr].w[w], cur.v[2 * pr + 1].w[w], h[pr]);
#if SCALE == 0
        const u32 mul = vsc[pr][VSB > 1 ? (w * EPW) / 16 : 0];
#elif SCALE == 1
        const int blk = (g * (D / 8) + w * EPW) / BLOCK;
        const u32 mul = pow2_f16(row_byte(cur.vs[2 * pr], blk), vtop[2 * pr]) |
                        (pow2_f16(row_byte(cur.vs[2 * pr + 1], blk), vtop[2 * pr + 1]) << 16);
#endif
#if SCALE < 2
#pragma unroll
        for (int jj = 0; jj < EPW; ++jj) h[pr][jj] = hmul2(h[pr][jj], mul);
#endif
      }
#pragma unroll
      for (int jj = 0; jj < EPW; jj += 2) {   // m tile (w EPW + jj) / 2: rows g <- pair jj, rows g + 8 <- jj + 1
        mma16816(acc[(w * EPW + jj) / 2], h[0][jj], h[0][jj + 1], h[1][jj], h[1][jj + 1], pb0, pb1);
#if G16
        mma16816(acc_hi[(w * EPW + jj) / 2], h[0][jj], h[0][jj + 1], h[1][jj], h[1][jj + 1], ph0, ph1);
#endif
      }
    }
  };

  const int stride = 16 * NW;
  int n = start + 16 * warp;
  Tile t0, t1;
  if (n < end) t0 = tile_at(n);
#if PREFETCH == 2
  Tile t2;
  if (n + stride < end) t1 = tile_at(n + stride);
#pragma unroll 1
  while (n < end) {
    if (n + 2 * stride < end) t2 = tile_at(n + 2 * stride);
    step(t0, n);
    if ((n += stride) >= end) break;
    if (n + 2 * stride < end) t0 = tile_at(n + 2 * stride);
    step(t1, n);
    if ((n += stride) >= end) break;
    if (n + 2 * stride < end) t1 = tile_at(n + 2 * stride);
    step(t2, n);
    n += stride;
  }
#else
#pragma unroll 1
  while (n < end) {
    if (n + stride < end) t1 = tile_at(n + stride);
    step(t0, n);
    if ((n += stride) >= end) break;
    if (n + stride < end) t0 = tile_at(n + stride);
    step(t1, n);
    n += stride;
  }
#endif

  // l over the quad; then the warps' (m, l, acc) merged through shared memory
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (q == 0) {
    sm_m[warp][g] = m;
    sm_l[warp][g] = l;
  }
#if G16
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  if (q == 0) {
    sm_m[warp][8 + g] = m_hi;
    sm_l[warp][8 + g] = l_hi;
  }
#endif
  const float units = SCALE == 1 ? factor_of(v_exp) : SCALE == 2 ? v_top : 1.f;
#pragma unroll
  for (int i = 0; i < MTILES; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {   // rows g (pair J = 2i) and g + 8 (J = 2i + 1) of m tile i
      const int J = 2 * i + r;
      const int dim = g * (D / 8) + (J / EPW) * EPW + v_dim(J % EPW);
      sm_acc[warp][2 * q][dim] = acc[i][2 * r] * units;
      sm_acc[warp][2 * q + 1][dim] = acc[i][2 * r + 1] * units;
#if G16
      sm_acc[warp][8 + 2 * q][dim] = acc_hi[i][2 * r] * units;
      sm_acc[warp][9 + 2 * q][dim] = acc_hi[i][2 * r + 1] * units;
#endif
    }
  }
  __syncthreads();
  const float out_scale = WIDEN_SCALE * vs_static;
  for (int idx = tid; idx < group * D; idx += NT) {
    const int h = idx / D, dim = idx % D;
    float mm = NEG_INF;
#pragma unroll
    for (int w = 0; w < NW; ++w) mm = fmaxf(mm, sm_m[w][h]);
    const float m_use = mm == NEG_INF ? 0.f : mm;
    float ll = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float e = ex2(sm_m[w][h] - m_use);
      ll += sm_l[w][h] * e;
      o += sm_acc[w][h][dim] * e;
    }
    const int head = kv_head * group + h;
    const bool empty = ll == 0.f;
    const float value = empty ? 0.f : o * (out_scale / ll), lse2 = empty ? NEG_INF : mm + log2f(ll);
    if (direct) {   // one split: the output and natural-log lse as the merge would write them (x 1 and + 0, exact)
      u16 bits;
#if Q_BF16
      asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
#else
      asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
#endif
      out_ptr[b * s_xb + (i64)head * s_xh + dim] = bits;
      if (dim == 0) lse_ptr[b * s_lb + head] = lse2 * 0.6931471805599453f;   // ln 2, the merge's constant
    } else {
      part_out[b * s_ob + (i64)head * s_oh + (i64)split * s_os + dim] = value;
      if (dim == 0) part_lse[b * s_eb + (i64)head * s_eh + split] = lse2;
    }
  }
}
