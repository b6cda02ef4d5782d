// Shared by the MLA decode kernels (kernels/mla_decode_fp8.cu, kernels/mla_decode_fp8_ws.cu,
// kernels/mla_decode_block_scaled.cu; the GQA decode kernels/gqa_decode_block_scaled.cu uses its scalar types and
// helpers): the cache row, the scalar types, fp8 widening (FMT_E5M2) and query conversion (Q_BF16), the stage layout
// of tile rows (BULK: bulk copies, the default; 0: cp.async) and the mbarrier wait. kernels/nvrtc.py inlines it into
// the including source before compiling (so its text is part of the compiled-kernel cache key).

#define LAT 512
#define ROPE 64
#define ROW (LAT + ROPE)               // bytes per cache row
#ifndef BULK
#define BULK 1
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;
typedef unsigned long long u64;

struct __align__(16) U4 { u32 x, y, z, w; };
struct __align__(16) F4 { float x, y, z, w; };
struct __align__(8) F2 { float x, y; };
struct __align__(8) u32x2 { u32 x, y; };
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u32 widen2(u32 codes) {   // the two fp8 codes in the low 16 bits -> f16x2 (exact)
  u32 r;
#if FMT_E5M2
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"((u16)codes));
#else
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((u16)codes));
#endif
  return r;
}

// The two fp8 codes in the high 16 bits -> f16x2 (exact). The word's high half as a 16-bit PTX register: ptxas reads
// it with an operand selector (.H1) where widen2(codes >> 16) costs a shift (session 15: 8% of the 16-head kernel's
// tile-loop instructions).
__device__ __forceinline__ u32 widen2_hi(u32 codes) {
  u32 r;
#if FMT_E5M2
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e5m2x2 %0, hi;\n}" : "=r"(r) : "r"(codes));
#else
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(r) : "r"(codes));
#endif
  return r;
}

// mma.sync.m16n8k16, f16 in, f32 accumulated in place: A's four registers, B's two (the MLA kernels; the GQA kernel
// has its own, A's registers apart)
__device__ __forceinline__ void mma16816(float* d, const u32* a, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// The e2m1 nibbles in the low (high) half of each byte -> e4m3 bytes of value x 2^-6: s e1 e0 m -> s 0 e1 e0 m 0 0
// (then cvt.rn.f16x2.e4m3x2 widens a pair exactly; the 2^6 goes into the caller's scales).
__device__ __forceinline__ u32 e4m3_of_low(u32 w) { return ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u); }
__device__ __forceinline__ u32 e4m3_of_high(u32 w) { return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u); }

// The value of an e8m0 byte: 2^(e - 127) (e = 0: 2^-127, a subnormal), 255 NaN.
__device__ __forceinline__ float e8m0_value(int e) {
  return e == 255 ? __int_as_float(0x7fc00000) : e > 0 ? __int_as_float(e << 23) : __int_as_float(1 << 22);
}

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u32 pack_half2_same(float x) {   // x rounded to fp16, in both halves
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ u32 half2_of(u32 two) {   // two query elements (bf16 or fp16) as f16x2 (RTNE)
#if Q_BF16
  return pack_half2(__uint_as_float(two << 16), __uint_as_float(two & 0xffff0000u));
#else
  return two;
#endif
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// The online softmax of one tile for rows g and g + 8 of an m16 head tile, shared by the MLA kernels: `sc` the
// tile's scores in the accumulator layout of its n8 blocks, in base 2 and masked; the running m and l and the
// accumulator o rescaled; P rounded to fp16 as the A fragments of P . C (the accumulator layout of n8 blocks 2j and
// 2j + 1 is the A layout of k step j). FACTORS: P's fragments (not l) take fac[jb][e], the factor of n8 block jb's
// column 2q + e, before rounding (kernels/mla_decode_block_scaled.cu: fp8_ds_mla's tile scales, MX's token exponents).
// LANE_L: l is the lane's own sum (its columns 2q, 2q + 1 of every n8 block), summed over the quad by the caller at
// the end (kernels/mla_decode_latent_split.cu, whose other tiles add lane sums without shuffles).
template <int BN_, int NPC_, bool FACTORS = false, bool LANE_L = false>
__device__ __forceinline__ void online_softmax(const float (&sc)[BN_ / 8][4], float (&m)[2], float (&l)[2],
                                               float (&o)[NPC_][4], u32 (&pa)[BN_ / 16][4],
                                               const float (*fac)[2] = nullptr) {
  float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
  for (int j = 0; j < BN_ / 8; ++j) {
    mx0 = fmaxf(mx0, fmaxf(sc[j][0], sc[j][1]));
    mx1 = fmaxf(mx1, fmaxf(sc[j][2], sc[j][3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float mn0 = fmaxf(m[0], mx0), mn1 = fmaxf(m[1], mx1);
  const float al0 = ex2(m[0] - mn0), al1 = ex2(m[1] - mn1);
  float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
  for (int j = 0; j < BN_ / 16; ++j) {
    const float p00 = ex2(sc[2 * j][0] - mn0), p01 = ex2(sc[2 * j][1] - mn0);
    const float p02 = ex2(sc[2 * j][2] - mn1), p03 = ex2(sc[2 * j][3] - mn1);
    const float p10 = ex2(sc[2 * j + 1][0] - mn0), p11 = ex2(sc[2 * j + 1][1] - mn0);
    const float p12 = ex2(sc[2 * j + 1][2] - mn1), p13 = ex2(sc[2 * j + 1][3] - mn1);
    rs0 += (p00 + p01) + (p10 + p11);
    rs1 += (p02 + p03) + (p12 + p13);
    if (FACTORS) {
      pa[j][0] = pack_half2(p00 * fac[2 * j][0], p01 * fac[2 * j][1]);
      pa[j][1] = pack_half2(p02 * fac[2 * j][0], p03 * fac[2 * j][1]);
      pa[j][2] = pack_half2(p10 * fac[2 * j + 1][0], p11 * fac[2 * j + 1][1]);
      pa[j][3] = pack_half2(p12 * fac[2 * j + 1][0], p13 * fac[2 * j + 1][1]);
    } else {
      pa[j][0] = pack_half2(p00, p01);
      pa[j][1] = pack_half2(p02, p03);
      pa[j][2] = pack_half2(p10, p11);
      pa[j][3] = pack_half2(p12, p13);
    }
  }
  if (!LANE_L) {
    rs0 += __shfl_xor_sync(0xffffffffu, rs0, 1);
    rs0 += __shfl_xor_sync(0xffffffffu, rs0, 2);
    rs1 += __shfl_xor_sync(0xffffffffu, rs1, 1);
    rs1 += __shfl_xor_sync(0xffffffffu, rs1, 2);
  }
  l[0] = l[0] * al0 + rs0;
  l[1] = l[1] * al1 + rs1;
  m[0] = mn0;
  m[1] = mn1;
#pragma unroll
  for (int n = 0; n < NPC_; ++n) {
    o[n][0] *= al0; o[n][1] *= al0; o[n][2] *= al1; o[n][3] *= al1;
  }
}

// One tile's online softmax for rows g and g + 8 of m16 head tile mt, shared by the MLA kernels' pipelines
// (kernels/mla_decode_fp8.cu's header): the tile's scores as the warps stored them (`scores`: [NW][32 lanes][MT][NB]
// x 4, n8 block j = warp' * NB + i), times qk (base 2) and masked past `end` where the tile is `partial`, then
// `online_softmax`. Every warp runs it over the whole tile, so m and l agree bit for bit across warps. FACTORS: token
// 8 jb + 2q + e's factor is fac[jb][e].
template <int NW_, int NB_, int MT_, int NPC_, bool FACTORS = false>
__device__ __forceinline__ void softmax_tile(const float* scores, int lane, int q, int mt, float qk, bool partial,
                                             int t0, int end, float (&m)[MT_][2], float (&l)[MT_][2],
                                             float (&o)[MT_][NPC_][4], u32 (&pa)[MT_][NW_ * NB_ / 2][4],
                                             const float (*fac)[2] = nullptr) {
  constexpr int BN_ = NW_ * NB_ * 8;
  float sc[BN_ / 8][4];
#pragma unroll
  for (int w2 = 0; w2 < NW_; ++w2) {
    const F4* theirs = (const F4*)(scores + (w2 * 32 + lane) * MT_ * NB_ * 4) + mt * NB_;
#pragma unroll
    for (int i = 0; i < NB_; ++i) {
      const F4 v = theirs[i];
      sc[w2 * NB_ + i][0] = v.x; sc[w2 * NB_ + i][1] = v.y; sc[w2 * NB_ + i][2] = v.z; sc[w2 * NB_ + i][3] = v.w;
    }
  }
#pragma unroll
  for (int j = 0; j < BN_ / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = sc[j][e] * qk;
      if (partial && t0 + 8 * j + 2 * q + (e & 1) >= end) v = NEG_INF;
      sc[j][e] = v;
    }
  online_softmax<BN_, NPC_, FACTORS>(sc, m[mt], l[mt], o[mt], pa[mt], fac);
}

// q_pe . k_pe, an MMA in the query's own type (bf16 or fp16: both operands exact)
__device__ __forceinline__ void mma_pe(float* d, const u32* a, u32 b0, u32 b1) {
#if Q_BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  mma16816(d, a, b0, b1);
#endif
}

// Where byte `byte` of tile row `row` sits in a stage buffer. cp.async (BULK 0): 16-byte chunks XOR-swizzled by
// (row & 6). Bulk copies (BULK 1, one per row, sm_90): whole rows, row r shifted by 32 x ((r >> 1) & 3) bytes
// modulo 128 (plus 128 bytes every 8 rows, so that shifted rows never overlap). Either way the 16-byte loads of
// Q . C^T (rows r, r + 1 in a quarter warp) and the 4-byte loads of P . C (rows 2q + e for q = 0..3, one 32-byte
// window) fall in distinct banks.
#if BULK
#define STAGE_BYTES (BN * (ROW + 16))
__device__ __forceinline__ int at(int row, int byte) {
  return row * ROW + 32 * ((row >> 1) & 3) + 128 * (row >> 3) + byte;
}
#else
#define STAGE_BYTES (BN * ROW)
__device__ __forceinline__ int at(int row, int byte) {
  const int s = row & 6, ch = byte >> 4;
  const int sw = ch < LAT / 16 ? ((ch & ~7) | ((ch ^ s) & 7)) : (LAT / 16 + ((ch - LAT / 16) ^ (s & 3)));
  return row * ROW + sw * 16 + (byte & 15);
}
#endif

// The block's split in the split-KV grid every MLA kernel launches (head block x, sequence y, split z): hb, split, b,
// and the split's tokens [start, end) in n_tiles tiles of BN (none for a split past the sequence's end). Expects
// tokens_per_split, seq_lens and BN in scope.
#define MLA_SPLIT_SPAN                                                                                                \
  const int hb = blockIdx.x, split = blockIdx.z;                                                                      \
  const i64 b = blockIdx.y;                                                                                           \
  const int start = split * tokens_per_split;                                                                         \
  const int end = min(start + tokens_per_split, seq_lens[b]);                                                         \
  const int n_tiles = (max(end - start, 0) + BN - 1) / BN
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void wait_parity(u32 bar, u32 parity) {
  u32 done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

// One tile row into shared memory at `dst` by an sm_90 bulk copy, counted by mbarrier `bar`: one arrival expecting
// the row's bytes. src nullptr: the arrival alone, expecting none (the caller zeroes that row).
__device__ __forceinline__ void bulk_row(u32 bar, u32 dst, const u8* src) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(src ? ROW : 0) : "memory");
  if (src)
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "n"(ROW), "r"(bar) : "memory");
}

// Where cache row `tok` of sequence b sits: its page from the block table, then its slot (PAGE: the page size).
__device__ __forceinline__ const u8* cache_row(const u8* cache, const int* block_table, i64 b, int s_tb, int s_cb,
                                               int s_cs, int tok) {
  return cache + (i64)block_table[b * s_tb + tok / PAGE] * s_cb + (i64)(tok % PAGE) * s_cs;
}
