// GQA decode over a paged 4-bit cache, split-KV: NVFP4 (e2m1 codes, an e4m3 scale per 16 values, a static fp32 scale
// per tensor or KV head; INT4 0) or INT4 per token-head (two's-complement codes, one fp32 scale per token and KV head;
// INT4 1). The CUDA kernel of kernels/decode_attention_block_scaled.py's impl="cuda" entries (compiled at first use by
// NVRTC, kernels/nvrtc.py; sm_89 and later). Defines: INT4, HEAD_DIM (64, 128 or 256), PAGE (a multiple of 16), CS
// and SS (bytes from one slot's codes and scales to the next's), NW warps, CTAS blocks per SM (launch bounds),
// PREFETCH tiles loaded ahead (1 or 2), Q_BF16. Up to 8 query heads per KV head.
//
// Same definition and partial layout as the Triton kernel (kernels/decode_attention_block_scaled.py): the K and V
// tiles hold element x block scale in fp16, exactly; q is rounded to fp16; scores and accumulation are fp32; online
// softmax in base 2 with P rounded to fp16 for P.V; out = v_scale x acc / l and lse2 = m + log2(l) per split, the
// splits merged by kernels/decode_attention.merge_splits. Tokens past the sequence's end add nothing (their scores
// are -inf and their V codes and scales are zeroed, so a NaN in a stale slot never meets P = 0).
//
// Why a hand-written kernel (kernels/BENCHMARKS.md, session 16): the Triton kernel is issue-bound, not memory-bound
// (19-43% of copy bandwidth), its tiles widened in the load layout and moved into the MMA operand layouts by
// register shuffles, the query fragments reloaded each tile. Here every value is widened in registers straight into
// the mma.sync.m16n8k16 (f16 in, f32 accumulate) fragment that uses it, nothing crosses lanes but the softmax's
// row maxima, the query stays in registers, and each warp walks its own 16-token tiles (no barrier in the loop):
// - Widening: an e2m1 nibble (s e1 e0 m) becomes the e4m3 byte s 00e1e0 m00, whose value is the element's x 2^-6
//   (exact, subnormals included), four a 32-bit word in three or four integer ops (`e4m3_of_low`, `e4m3_of_high`);
//   cvt.rn.f16x2.e4m3x2 widens two at a time; the block scale (e4m3, exact in fp16) multiplies an f16x2 pair
//   (mul.f16x2: element x scale has at most 6 significant bits and lies in [2^-16, 42]: exact); 2^6 is folded into
//   the softmax scale (K) and the output scale (V).
// - Q . K^T: A = Q (16 rows, one per query head; rows past the group are zeros), B = K^T (n = 8 tokens). A lane
//   (g = lane / 4, q = lane % 4) reads one run of codes of tokens g and g + 8 (a quarter of their head, D / 8 bytes:
//   16 at head size 128): the MMA sums over k in any order, so the f16x2 pairs the cvt yields are the k pairs of the
//   B fragment as they come, and Q's fragment is gathered in the same order once, before the loop.
// - P . V: the output transposed, A = V^T (m = 16 head dims, k = 16 tokens), B = P^T (k = 16 tokens, n = 8 query
//   heads): B is exactly the Q . K^T accumulator of the same lane (rows g), so P never crosses lanes. A lane reads
//   one run of codes of each of 4 tokens (an eighth of their head: one scale block at head size 128) and interleaves
//   two tokens' code bytes with a byte permute (prmt) before widening, so each cvt yields one head dim's pair of
//   tokens; the head dims land in a permuted order that the output store puts back. Each m16 tile of head dims is
//   one MMA: 8 at head size 128 (16 for Q . K^T).
// - INT4: a nibble n goes into an fp16 1024 + (n ^ 8), less 1032 (two ops a pair: exact, no scale multiply); the
//   pairs are elements (0, 4), (1, 5), ... of a code word. K's per-token scale multiplies the score; V's goes into P's
//   column over the largest V scale so far (P stays <= 1), the accumulator kept in that largest's units.
// - The accumulator is rescaled only when some row's running maximum (or int4's largest V scale) moved (a warp
//   vote): multiplying by 1 is exact, so this skips work without changing a bit.
// - The next tiles' codes and scales are loaded into registers while this one is computed; at the end the warps of a
//   block merge their (m, l, acc) through shared memory and write one partial per split. (The splits merged by a
//   CUDA kernel as a programmatic dependent launch, as the MLA kernel's are, measured no faster: session 25.)

#include "mla_fp8_common.cuh"

#define D HEAD_DIM
#define NT (NW * 32)
#define KW (D / 32)         // 32-bit code words of K a lane reads per token (D / 4 values)
#define VW (D / 64)         // of V (D / 8 values)
#define KSB (D / 64)        // K scale bytes a lane reads per token (its D / 4 values span D / 64 blocks)
#define MTILES (D / 16)     // m16 tiles of head dims in P . V (and k16 steps in Q . K^T)
#define GROUP_MAX 8
#ifndef PREFETCH
#define PREFETCH 1
#endif

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// The e2m1 nibbles in the low (high) half of each byte -> e4m3 bytes of value x 2^-6: s e1 e0 m -> s 0 e1 e0 m 0 0.
__device__ __forceinline__ u32 e4m3_of_low(u32 w) { return ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u); }
__device__ __forceinline__ u32 e4m3_of_high(u32 w) { return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u); }

// Two int4 codes (two's-complement nibbles at bits 0-3 and 16-19) -> f16x2, exactly: each placed in an fp16
// 1024 + (n ^ 8) (exponent bits 0x64), then 1032 subtracted.
__device__ __forceinline__ u32 int4_pair(u32 x) {
  u32 t, r;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x64086408, 0x6A;" : "=r"(t) : "r"(x));   // (x & 0x000F000F) ^ 0x64086408
  asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(t), "r"(0x64086408u));
  return r;
}

// An f16x2 scale pair -> each half in both halves.
__device__ __forceinline__ u32 dup_lo(u32 x) { return prmt(x, 0, 0x1010); }
__device__ __forceinline__ u32 dup_hi(u32 x) { return prmt(x, 0, 0x3232); }

template <int N> struct Words { u32 w[N]; };

template <int N> __device__ __forceinline__ Words<N> load_words(const u8* p) {   // N x 4 bytes, 4N-byte aligned
  Words<N> r;
  if constexpr (N == 1) {
    r.w[0] = *(const u32*)p;
  } else if constexpr (N == 2) {
    const uint2 x = *(const uint2*)p;
    r.w[0] = x.x; r.w[1] = x.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint4 x = *(const uint4*)(p + 4 * i);
      r.w[i] = x.x; r.w[i + 1] = x.y; r.w[i + 2] = x.z; r.w[i + 3] = x.w;
    }
  }
  return r;
}

template <int N> __device__ __forceinline__ u32 load_bytes(const u8* p) {   // N = 1, 2 or 4 bytes, N-aligned
  if constexpr (N == 1) return *p;
  else if constexpr (N == 2) return *(const u16*)p;
  else return *(const u32*)p;
}

// What a lane reads of one 16-token tile.
struct Tile {
  Words<KW> k[2];   // K codes of tokens g and 8 + g, quarter q of the head
  Words<VW> v[4];   // V codes of tokens 2q, 2q + 1, 2q + 8, 2q + 9, eighth g of the head
#if INT4
  float ks[4];      // the K and V scales of tokens 2q, 2q + 1, 2q + 8, 2q + 9 (the score fragment's tokens)
  float vs[4];
#else
  u32 ks[2];        // the K scale bytes of tokens g, 8 + g (KSB of them)
  u32 vs[4];        // the V scale bytes of tokens 2q, 2q + 1, 2q + 8, 2q + 9 (1, or 2 at head size 256)
#endif
};

#define VSB (D >= 256 ? 2 : 1)

// The tile's loads from this lane's bases (the lane's first byte on page 0, loop invariant) plus the page's offset:
// a slot's bytes are CS (codes) and SS (scales) after the previous slot's, compile-time strides, so each load
// is one base for the tile plus an immediate.
__device__ __forceinline__ Tile load_tile(const u8* kp, const u8* vp, const u8* ksp, const u8* vsp) {
  Tile t;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    t.k[i] = load_words<KW>(kp + 8 * i * CS);
#if !INT4
    t.ks[i] = load_bytes<KSB>(ksp + 8 * i * SS);
#endif
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tok = (i & 1) + 8 * (i >> 1);
    t.v[i] = load_words<VW>(vp + tok * CS);
#if INT4
    t.ks[i] = *(const float*)(ksp + tok * SS);
    t.vs[i] = *(const float*)(vsp + tok * SS);
#else
    t.vs[i] = load_bytes<VSB>(vsp + tok * SS);
#endif
  }
  return t;
}

extern "C" __global__ void __launch_bounds__(NT, CTAS) gqa_4bit_decode(
    const u16* __restrict__ q_ptr, const u8* __restrict__ k_codes, const u8* __restrict__ v_codes,
    const u8* __restrict__ k_scales, const u8* __restrict__ v_scales, const int* __restrict__ block_table,
    const int* __restrict__ seq_lens, const float* __restrict__ k_static, const float* __restrict__ v_static,
    float* __restrict__ part_out, float* __restrict__ part_lse, double sm_scale_log2, int tokens_per_split,
    int group, int k_static_stride, int v_static_stride, int has_static, int s_qb, int s_qh, int s_cb, int s_ch,
    int s_sb, int s_sh, int s_tb, int s_ob, int s_oh, int s_os, int s_eb, int s_eh) {
  __shared__ float sm_m[NW][GROUP_MAX], sm_l[NW][GROUP_MAX];
  __shared__ float sm_acc[NW][GROUP_MAX][D];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  const int kv_head = blockIdx.x, split = blockIdx.z;
  const i64 b = blockIdx.y;
  const int start = split * tokens_per_split;
  const int end = min(start + tokens_per_split, seq_lens[b]);
  const float ks_static = has_static ? k_static[kv_head * k_static_stride] : 1.f;
  const float vs_static = has_static ? v_static[kv_head * v_static_stride] : 1.f;
  const float qk_scale = (float)sm_scale_log2 * (INT4 ? 1.f : 64.f) * ks_static;   // 64: e2m1 widened x 2^-6

  // Q's A fragments (rows g; rows g + 8 and rows past the group are zeros), in the order the K codes widen: the
  // half2 pairs of code word w of a lane's quarter come as elements (0, 2), (4, 6), (1, 3), (5, 7) of the word
  // (e2m1), or (0, 4), (1, 5), (2, 6), (3, 7) (int4).
  u32 qa[MTILES][2];
  {
    const u16* qrow = q_ptr + b * s_qb + (i64)(kv_head * group + g) * s_qh + q * (D / 4);
#pragma unroll
    for (int j = 0; j < 2 * MTILES; ++j) {
      const int w = j >> 2, i = j & 3;
      const int lo = INT4 ? 8 * w + i : 8 * w + ((i & 1) << 2) + (i >> 1), hi = lo + (INT4 ? 4 : 2);
      u32 pair = 0;
      if (g < group) pair = half2_of((u32)qrow[lo] | ((u32)qrow[hi] << 16));
      qa[j >> 1][j & 1] = pair;
    }
  }

  float m = NEG_INF, l = 0.f;
  float v_top = 0.f;   // int4: the largest V scale so far; the accumulator holds P . V in its units
  float acc[MTILES][4];
#pragma unroll
  for (int i = 0; i < MTILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  const int* table = block_table + b * s_tb;
  // this lane's bytes of slot 0 of page 0: K codes and scales of tokens g (+ 8), V's of tokens 2q (+ 1, 8, 9)
  const u8* k_lane = k_codes + (i64)kv_head * s_ch + g * CS + q * (D / 8);
  const u8* v_lane = v_codes + (i64)kv_head * s_ch + 2 * q * CS + g * (D / 16);
  // scales: NVFP4's K scale bytes of tokens g (+ 8), this lane's blocks; V's of tokens 2q (+ 1, 8, 9), block of
  // eighth g; int4's one fp32 per token, K's and V's of tokens 2q (+ 1, 8, 9)
  const u8* ks_lane = k_scales + (i64)kv_head * s_sh + (INT4 ? 2 * q * SS : g * SS + q * KSB);
  const u8* vs_lane = v_scales + (i64)kv_head * s_sh + 2 * q * SS + (INT4 ? 0 : (g * D) / 128);
  auto tile_at = [&](int n0) -> Tile {   // tiles start at multiples of 16: at page size 16, at a page's first slot
    const i64 page = table[n0 / PAGE], slot = PAGE == 16 ? 0 : n0 % PAGE;
    return load_tile(k_lane + page * s_cb + slot * CS, v_lane + page * s_cb + slot * CS,
                     ks_lane + page * s_sb + slot * SS, vs_lane + page * s_sb + slot * SS);
  };

  // One tile: its scores, the online softmax, P . V.
  auto step = [&](Tile& cur, const int n0) {
    // Q . K^T: s[i] = scores of tokens 8i + 2q, 8i + 2q + 1 for head g (rows g + 8 unused)
    float s[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#if INT4
#pragma unroll
      for (int w = 0; w < KW; ++w) {
        const u32 c = cur.k[i].w[w];
        mma16816(s[i], qa[2 * w][0], 0u, qa[2 * w][1], 0u, int4_pair(c), int4_pair(c >> 4));
        mma16816(s[i], qa[2 * w + 1][0], 0u, qa[2 * w + 1][1], 0u, int4_pair(c >> 8), int4_pair(c >> 12));
      }
#else
      const u32 sc = widen2(cur.ks[i] | (KSB > 1 ? 0u : cur.ks[i] << 8));   // this lane's block scales as f16
#pragma unroll
      for (int w = 0; w < KW; ++w) {
        const u32 blk = KSB == 1 ? sc : (KSB == 2 ? ((w >> 1) ? dup_hi(sc) : dup_lo(sc))
                                                  : ((w >> 2) ? ((w >> 1) & 1 ? dup_hi(widen2_hi(cur.ks[i]))
                                                                                : dup_lo(widen2_hi(cur.ks[i])))
                                                              : ((w >> 1) & 1 ? dup_hi(sc) : dup_lo(sc))));
        const u32 lo = e4m3_of_low(cur.k[i].w[w]), hi = e4m3_of_high(cur.k[i].w[w]);
        const u32 b0 = hmul2(widen2(lo), blk), b1 = hmul2(widen2_hi(lo), blk);
        const u32 b2 = hmul2(widen2(hi), blk), b3 = hmul2(widen2_hi(hi), blk);
        mma16816(s[i], qa[2 * w][0], 0u, qa[2 * w][1], 0u, b0, b1);
        mma16816(s[i], qa[2 * w + 1][0], 0u, qa[2 * w + 1][1], 0u, b2, b3);
      }
#endif
    }

    // online softmax for head g over this lane's 4 tokens, the row maximum across the quad
    float x[4];   // tokens 2q, 2q + 1, 8 + 2q, 9 + 2q
#pragma unroll
    for (int i = 0; i < 4; ++i)
#if INT4
      x[i] = s[i >> 1][i & 1] * (cur.ks[i] * qk_scale);   // the token's K scale, in the Triton kernel's order
#else
      x[i] = s[i >> 1][i & 1] * qk_scale;
#endif
    const bool tail = n0 + 16 > end;
    if (tail) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (n0 + 8 * (i >> 1) + 2 * q + (i & 1) >= end) x[i] = NEG_INF;
    }
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float m_use = m_new == NEG_INF ? 0.f : m_new;
    const float alpha = ex2(m - m_use);
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = ex2(x[i] - m_use);
    l = l * alpha + ((p[0] + p[1]) + (p[2] + p[3]));
    m = m_new;
    if (tail) {   // V of the tokens past the end: codes and scales zeroed (a stale NaN would survive P = 0)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (n0 + 2 * q + (i & 1) + 8 * (i >> 1) >= end) {
#pragma unroll
          for (int w = 0; w < VW; ++w) cur.v[i].w[w] = 0u;
          cur.vs[i] = 0;
        }
    }
    float rescale = alpha;
#if INT4
    // each token's V scale into P's column, relative to the largest so far (P stays <= 1); the accumulator moves to
    // the new largest's units when it grows (every quad holds the same 16 tokens: the maximum is the warp's)
    float vt = fmaxf(fmaxf(cur.vs[0], cur.vs[1]), fmaxf(cur.vs[2], cur.vs[3]));
    vt = fmaxf(vt, __shfl_xor_sync(0xffffffffu, vt, 1));
    vt = fmaxf(vt, __shfl_xor_sync(0xffffffffu, vt, 2));
    const float v_new = fmaxf(v_top, vt), v_unit = v_new > 0.f ? v_new : 1.f;
    rescale *= v_top / v_unit;   // 0 before the first scale above 0, when the accumulator is still 0
    if (v_top == v_new) rescale = alpha;
    v_top = v_new;
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] *= cur.vs[i] / v_unit;
#endif
    if (__any_sync(0xffffffffu, rescale != 1.f)) {   // the accumulator's columns are heads 2q, 2q + 1
      const float a0 = __shfl_sync(0xffffffffu, rescale, 8 * q), a1 = __shfl_sync(0xffffffffu, rescale, 8 * q + 4);
#pragma unroll
      for (int i = 0; i < MTILES; ++i) {
        acc[i][0] *= a0; acc[i][1] *= a1; acc[i][2] *= a0; acc[i][3] *= a1;
      }
    }
    const u32 pb0 = pack_half2(p[0], p[1]), pb1 = pack_half2(p[2], p[3]);

    // P . V: V^T fragments from token pairs (2q, 2q + 1) and (2q + 8, 2q + 9)
#if INT4
#pragma unroll
    for (int w = 0; w < VW; ++w) {
      u32 h[2][8];   // [pair][j]: head dim 8w + j of the lane's eighth, tokens (a, b) of the pair
#pragma unroll
      for (int pr = 0; pr < 2; ++pr) {
        const u32 r0 = prmt(cur.v[2 * pr].w[w], cur.v[2 * pr + 1].w[w], 0x5410);   // a's bytes 0, 1, b's: dims 0-3
        const u32 r1 = prmt(cur.v[2 * pr].w[w], cur.v[2 * pr + 1].w[w], 0x7632);   // bytes 2, 3: dims 4-7
        h[pr][0] = int4_pair(r0); h[pr][1] = int4_pair(r0 >> 4); h[pr][2] = int4_pair(r0 >> 8);
        h[pr][3] = int4_pair(r0 >> 12); h[pr][4] = int4_pair(r1); h[pr][5] = int4_pair(r1 >> 4);
        h[pr][6] = int4_pair(r1 >> 8); h[pr][7] = int4_pair(r1 >> 12);
      }
#pragma unroll
      for (int j = 0; j < 8; j += 2)
        mma16816(acc[4 * w + j / 2], h[0][j], h[0][j + 1], h[1][j], h[1][j + 1], pb0, pb1);
    }
#else
    u32 vsc[2][VSB];   // f16x2 scales (token a, token b) of each pair, per block
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
      const u32 both = prmt(cur.vs[2 * pr], cur.vs[2 * pr + 1], 0x5140);   // a0 b0 a1 b1
      vsc[pr][0] = widen2(both);
      if (VSB > 1) vsc[pr][VSB - 1] = widen2_hi(both);
    }
#pragma unroll
    for (int w = 0; w < VW; ++w) {
      u32 h[2][8];   // [pair][j]: head dims 8w + (0, 2, 4, 6, 1, 3, 5, 7)[j] of the lane's eighth
#pragma unroll
      for (int pr = 0; pr < 2; ++pr) {
        const u32 sc = vsc[pr][VSB > 1 ? (w * 8 * 2) / (VW * 8) : 0];
        // the two tokens' bytes interleaved (a b a b), then each nibble half widened: pairs (a, b) of one head dim
        const u32 r0 = prmt(cur.v[2 * pr].w[w], cur.v[2 * pr + 1].w[w], 0x5140);   // bytes 0, 1: dims 0-3
        const u32 r1 = prmt(cur.v[2 * pr].w[w], cur.v[2 * pr + 1].w[w], 0x7362);   // bytes 2, 3: dims 4-7
        const u32 l0 = e4m3_of_low(r0), l1 = e4m3_of_low(r1), h0 = e4m3_of_high(r0), h1 = e4m3_of_high(r1);
        h[pr][0] = hmul2(widen2(l0), sc); h[pr][1] = hmul2(widen2_hi(l0), sc);
        h[pr][2] = hmul2(widen2(l1), sc); h[pr][3] = hmul2(widen2_hi(l1), sc);
        h[pr][4] = hmul2(widen2(h0), sc); h[pr][5] = hmul2(widen2_hi(h0), sc);
        h[pr][6] = hmul2(widen2(h1), sc); h[pr][7] = hmul2(widen2_hi(h1), sc);
      }
#pragma unroll
      for (int j = 0; j < 8; j += 2)   // m tile 4w + j / 2: rows g <- pair j, rows g + 8 <- pair j + 1
        mma16816(acc[4 * w + j / 2], h[0][j], h[0][j + 1], h[1][j], h[1][j + 1], pb0, pb1);
    }
#endif
  };

  // PREFETCH tiles in flight beside the one computed: PREFETCH + 1 register buffers taken in turn (the loop unrolled
  // over them, so no buffer is copied)
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
#pragma unroll
  for (int i = 0; i < MTILES; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {   // r: rows g (pair j even) and g + 8 (odd) of m tile i
      const int j = 2 * i + r, w = j >> 3, jj = j & 7;
      const int dim = g * (D / 8) + 8 * w + (INT4 ? jj : ((jj & 3) << 1) + (jj >> 2));
      sm_acc[warp][2 * q][dim] = acc[i][2 * r] * (INT4 ? v_top : 1.f);
      sm_acc[warp][2 * q + 1][dim] = acc[i][2 * r + 1] * (INT4 ? v_top : 1.f);
    }
  }
  __syncthreads();
  const float out_scale = (INT4 ? 1.f : 64.f) * vs_static;
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
    part_out[b * s_ob + (i64)head * s_oh + (i64)split * s_os + dim] = empty ? 0.f : o * (out_scale / ll);
    if (dim == 0) part_lse[b * s_eb + (i64)head * s_eh + split] = empty ? NEG_INF : mm + log2f(ll);
  }
}
