// GQA decode over a paged MXFP8 cache (e4m3 codes, an e8m0 scale per 32 values), split-KV. UNVALIDATED: written in
// session 25 without device time left (compiled by NVRTC and ptxas offline only); branch wip/mxfp8-cuda. Defines:
// HEAD_DIM (64, 128 or 256), PAGE (a multiple of 16), CS and SS (bytes from one slot's codes and scale row to the
// next's), NW warps, CTAS blocks per SM, PREFETCH (1 or 2), Q_BF16. Up to 8 query heads per KV head.
//
// The structure of kernels/gqa_decode_4bit.cu (its comment says why each piece is where it is); what differs:
// - Codes widen with one cvt.rn.f16x2.e4m3x2 a pair; the K pairs come as elements (0, 1), (2, 3) of each code word,
//   so Q's fragment pairs are consecutive elements.
// - e8m0 scales as the Triton kernel takes them: with E_j the token's largest block exponent (at least 1), the tile
//   holds element x 2^(e_jb - E_j) in fp16 (exact to 2^-24 of the token's largest; 255 is NaN) and 2^(E_j - 127) is
//   a per-token factor: on the score (K), and into P's column over the largest factor so far (V), as INT4's scale.
// - K: a lane's quarter of token g's head spans D / 128 blocks (a half block at head size 64); the score fragment's
//   tokens (2q, 2q + 1, 2q + 8, 2q + 9) get their K factors from the lanes that read those tokens (shuffles).
// - V: a lane's eighth of a head lies in one block; it reads the 4 tokens' whole scale rows (their E_j).

#include "mla_fp8_common.cuh"

#define D HEAD_DIM
#define NT (NW * 32)
#define KW (D / 16)         // 32-bit code words of K a lane reads per token (D / 4 values)
#define VW (D / 32)         // of V (D / 8 values)
#define SR (D / 32)         // scale bytes a token's row holds (one per 32 values)
#define SRW ((SR + 3) / 4)  // 32-bit words it takes
#define MTILES (D / 16)
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

template <int N> struct Words { u32 w[N]; };

template <int N> __device__ __forceinline__ Words<N> load_words(const u8* p) {   // N x 4 bytes, min(16, 4N)-aligned
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

__device__ __forceinline__ Words<SRW> load_row(const u8* p) {   // a token's scale row, SR bytes, SR-aligned
  Words<SRW> r;
  if constexpr (SR == 2) r.w[0] = *(const u16*)p;
  else r = load_words<SRW>(p);
  return r;
}

// The row's largest exponent byte, at least 1 (the Triton kernel's E_j + 127).
__device__ __forceinline__ int row_top(const Words<SRW>& r) {
  u32 m = r.w[0];
#pragma unroll
  for (int i = 1; i < SRW; ++i) m = __vmaxu4(m, r.w[i]);
  m = __vmaxu4(m, m >> 16);
  m = __vmaxu4(m, m >> 8);
  return max((int)(m & 0xFF), 1);
}

__device__ __forceinline__ int row_byte(const Words<SRW>& r, int i) { return (r.w[i >> 2] >> (8 * (i & 3))) & 0xFF; }

// 2^(e - top) as fp16 bits (top >= e unless e is 255): RTNE of the fp32 power, so 0 below 2^-24; 255 is NaN.
__device__ __forceinline__ u32 pow2_f16(int e, int top) {
  if (e == 255) return 0x7E00u;
  const int k = e - top;
  if (k >= -14) return (u32)(k + 15) << 10;
  if (k >= -24) return 1u << (k + 24);
  return 0u;
}

// 2^(top - 127) as fp32 (top >= 1: a normal float; 255: inf, then NaN downstream, as in the Triton kernel).
__device__ __forceinline__ float factor_of(int top) { return __uint_as_float((u32)top << 23); }

struct Tile {
  Words<KW> k[2];        // K codes of tokens g and 8 + g, quarter q of the head
  Words<SRW> kr[2];      // their K scale rows
  Words<VW> v[4];        // V codes of tokens 2q, 2q + 1, 2q + 8, 2q + 9, eighth g of the head
  Words<SRW> vr[4];      // their V scale rows
};

__device__ __forceinline__ Tile load_tile(const u8* kp, const u8* vp, const u8* ksp, const u8* vsp) {
  Tile t;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    t.k[i] = load_words<KW>(kp + 8 * i * CS);
    t.kr[i] = load_row(ksp + 8 * i * SS);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tok = (i & 1) + 8 * (i >> 1);
    t.v[i] = load_words<VW>(vp + tok * CS);
    t.vr[i] = load_row(vsp + tok * SS);
  }
  return t;
}

extern "C" __global__ void __launch_bounds__(NT, CTAS) gqa_mxfp8_decode(
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
  const float qk_scale = (float)sm_scale_log2 * ks_static;

  // Q's A fragments (rows g; rows past the group zeros): k step s of the lane's quarter holds elements 4s, 4s + 1
  // (a0) and 4s + 2, 4s + 3 (a2), the order the cvt widens code word s.
  u32 qa[MTILES][2];
  {
    const u16* qrow = q_ptr + b * s_qb + (i64)(kv_head * group + g) * s_qh + q * (D / 4);
#pragma unroll
    for (int j = 0; j < 2 * MTILES; ++j) {
      u32 pair = 0;
      if (g < group) pair = half2_of((u32)qrow[2 * j] | ((u32)qrow[2 * j + 1] << 16));
      qa[j >> 1][j & 1] = pair;
    }
  }

  float m = NEG_INF, l = 0.f, v_top = 0.f;
  float acc[MTILES][4];
#pragma unroll
  for (int i = 0; i < MTILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  const int* table = block_table + b * s_tb;
  const u8* k_lane = k_codes + (i64)kv_head * s_ch + g * CS + q * (D / 4);
  const u8* v_lane = v_codes + (i64)kv_head * s_ch + 2 * q * CS + g * (D / 8);
  const u8* ks_lane = k_scales + (i64)kv_head * s_sh + g * SS;
  const u8* vs_lane = v_scales + (i64)kv_head * s_sh + 2 * q * SS;
  auto tile_at = [&](int n0) -> Tile {
    const i64 page = table[n0 / PAGE], slot = PAGE == 16 ? 0 : n0 % PAGE;
    return load_tile(k_lane + page * s_cb + slot * CS, v_lane + page * s_cb + slot * CS,
                     ks_lane + page * s_sb + slot * SS, vs_lane + page * s_sb + slot * SS);
  };

  auto step = [&](Tile& cur, const int n0) {
    // Q . K^T, each code word's pairs times its block's 2^(e - top) for token g (or 8 + g)
    float s[2][4];
    int top[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
      top[i] = row_top(cur.kr[i]);
#pragma unroll
      for (int w = 0; w < KW; ++w) {
        const int blk = (q * (D / 4) + 4 * w) / 32;
        const u32 mh = pow2_f16(row_byte(cur.kr[i], blk), top[i]);
        const u32 mul = mh | (mh << 16);
        const u32 c = cur.k[i].w[w];
        mma16816(s[i], qa[w][0], 0u, qa[w][1], 0u, hmul2(widen2(c), mul), hmul2(widen2_hi(c), mul));
      }
    }
    // the score fragment's tokens 2q, 2q + 1 (n8 block 0) and 8 + 2q, 9 + 2q (block 1): their tops from the lanes
    // that read them (g = 2q, 2q + 1)
    const int t00 = __shfl_sync(0xffffffffu, top[0], 8 * q), t01 = __shfl_sync(0xffffffffu, top[0], 8 * q + 4);
    const int t10 = __shfl_sync(0xffffffffu, top[1], 8 * q), t11 = __shfl_sync(0xffffffffu, top[1], 8 * q + 4);
    float x[4] = {s[0][0] * (factor_of(t00) * qk_scale), s[0][1] * (factor_of(t01) * qk_scale),
                  s[1][0] * (factor_of(t10) * qk_scale), s[1][1] * (factor_of(t11) * qk_scale)};
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

    // V: tokens past the end zeroed (codes and scale rows); each token's factor into P's column over the largest
    // so far, the accumulator in that largest's units
    if (tail) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (n0 + 2 * q + (i & 1) + 8 * (i >> 1) >= end) {
#pragma unroll
          for (int w = 0; w < VW; ++w) cur.v[i].w[w] = 0u;
#pragma unroll
          for (int w = 0; w < SRW; ++w) cur.vr[i].w[w] = 0u;
        }
    }
    int vtop[4];
    float vf[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      vtop[i] = row_top(cur.vr[i]);
      vf[i] = factor_of(vtop[i]);
      if (tail && n0 + 2 * q + (i & 1) + 8 * (i >> 1) >= end) vf[i] = 0.f;
    }
    float vt = fmaxf(fmaxf(vf[0], vf[1]), fmaxf(vf[2], vf[3]));
    vt = fmaxf(vt, __shfl_xor_sync(0xffffffffu, vt, 1));
    vt = fmaxf(vt, __shfl_xor_sync(0xffffffffu, vt, 2));
    const float v_new = fmaxf(v_top, vt), v_unit = v_new > 0.f ? v_new : 1.f;
    const float rescale = v_top == v_new ? alpha : alpha * (v_top / v_unit);
    v_top = v_new;
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] *= vf[i] / v_unit;
    if (__any_sync(0xffffffffu, rescale != 1.f)) {   // the accumulator's columns are heads 2q, 2q + 1
      const float a0 = __shfl_sync(0xffffffffu, rescale, 8 * q), a1 = __shfl_sync(0xffffffffu, rescale, 8 * q + 4);
#pragma unroll
      for (int i = 0; i < MTILES; ++i) {
        acc[i][0] *= a0; acc[i][1] *= a1; acc[i][2] *= a0; acc[i][3] *= a1;
      }
    }
    const u32 pb0 = pack_half2(p[0], p[1]), pb1 = pack_half2(p[2], p[3]);

    // P . V: the lane's eighth lies in block (g * D / 8) / 32; pairs (a, b) of one head dim, times (2^(e_a - top_a),
    // 2^(e_b - top_b))
    const int blk = (g * (D / 8)) / 32;
    u32 mul[2];
#pragma unroll
    for (int pr = 0; pr < 2; ++pr)
      mul[pr] = pow2_f16(row_byte(cur.vr[2 * pr], blk), vtop[2 * pr]) |
                (pow2_f16(row_byte(cur.vr[2 * pr + 1], blk), vtop[2 * pr + 1]) << 16);
#pragma unroll
    for (int w = 0; w < VW; ++w) {
      u32 h[2][4];   // [pair][j]: head dim 4w + j of the lane's eighth
#pragma unroll
      for (int pr = 0; pr < 2; ++pr) {
        const u32 r0 = prmt(cur.v[2 * pr].w[w], cur.v[2 * pr + 1].w[w], 0x5140);   // a0 b0 a1 b1
        const u32 r1 = prmt(cur.v[2 * pr].w[w], cur.v[2 * pr + 1].w[w], 0x7362);   // a2 b2 a3 b3
        h[pr][0] = hmul2(widen2(r0), mul[pr]); h[pr][1] = hmul2(widen2_hi(r0), mul[pr]);
        h[pr][2] = hmul2(widen2(r1), mul[pr]); h[pr][3] = hmul2(widen2_hi(r1), mul[pr]);
      }
      // m tiles 2w (dims 4w, 4w + 1: rows g, g + 8) and 2w + 1 (dims 4w + 2, 4w + 3)
      mma16816(acc[2 * w], h[0][0], h[0][1], h[1][0], h[1][1], pb0, pb1);
      mma16816(acc[2 * w + 1], h[0][2], h[0][3], h[1][2], h[1][3], pb0, pb1);
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

  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (q == 0) {
    sm_m[warp][g] = m;
    sm_l[warp][g] = l;
  }
#pragma unroll
  for (int i = 0; i < MTILES; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {   // m tile i: rows g (dim 2i of the eighth, r = 0) and g + 8 (2i + 1)
      const int dim = g * (D / 8) + 2 * i + r;
      sm_acc[warp][2 * q][dim] = acc[i][2 * r] * v_top;
      sm_acc[warp][2 * q + 1][dim] = acc[i][2 * r + 1] * v_top;
    }
  }
  __syncthreads();
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
    part_out[b * s_ob + (i64)head * s_oh + (i64)split * s_os + dim] = empty ? 0.f : o * (vs_static / ll);
    if (dim == 0) part_lse[b * s_eb + (i64)head * s_eh + split] = empty ? NEG_INF : mm + log2f(ll);
  }
}
