// MLA decode over a paged NVFP4 latent stored as one record a token ([256 code bytes | 32 e4m3 block scales | 64 k_pe
// values in the query's 16-bit type], the engine's pages), over vLLM's fp8_ds_mla record ([512 e4m3 codes | 4 fp32
// tile scales | 64 k_pe], ELEM_E4M3 below), MX records (E8M0) or the plain FP8 cache (FP8_PE), split-KV, with the
// latent split between the warps: the CUDA kernel of kernels/mla_block_scaled_cuda.py for those records (compiled at
// first use by NVRTC, kernels/nvrtc.py; sm_90: bulk copies, mbarriers). Defines: STAGES tiles in flight, PAGE page
// size, CTAS blocks per SM (launch bounds), Q_BF16, HAS_SCALE, REG_T, ELEM_E4M3, E8M0, FP8_PE (below).
//
// The definition is kernels/mla_decode_block_scaled.cu's (read its header): s_j = sm_scale * (scale * q_latent . c_j
// + q_pe . pe_j), q_latent rounded to fp16, each e2m1 value times its block scale widened exactly into fp16 (x 2^-6),
// scores and accumulation in fp32, online softmax in base 2 with P rounded to fp16 for P . C; out = acc / l and lse2 =
// m + log2(l) per split, kernels/splits.merge_splits combines the splits. Here the running maximum m may lag the
// scores by up to LAZY (below), so P reaches 2^LAZY; only the order and scaling of the fp32 sums differ.
//
// Why another shape (kernels/BENCHMARKS.md, sessions 33-34 and 45): at 16 heads that kernel's warps split a tile's
// tokens for Q . C^T, so each warp needs all of Q's 36 k steps, which it reloads from shared memory every tile (73 KB
// a block a tile, more than the tile itself), and it widens every value twice, once for each product. Here:
// - Warp w (of 4) owns latent columns 128w .. 128w + 127 and k_pe dims 16w .. 16w + 15 for both products, so its Q
//   fragments (9 k steps) live in registers and it reads only its quarter of each row.
// - Q . C^T: each warp's partial scores of the tile's 32 tokens (4 n8 blocks) go to shared memory; after a barrier of
//   the 4 warps warp w sums n8 block w's four partials (one order of addition, so m and l agree to the bit across
//   warps) and turns them into P against the running maximum m every warp holds; after a second barrier every warp
//   reads the four P blocks and adds their sums to l. (Each warp summing all sixteen partials itself read 40 KB of
//   shared memory a tile against 26, and was 6% slower.)
// - The lazy maximum (FlashAttention-4's): m moves only at the first tile and at a tile with a score more than LAZY
//   (8, base 2) above it. Such a tile takes the full online softmax: every warp reads the four sums, the accumulators
//   are rescaled. So P <= 2^8 in fp16 and the accumulators are not rescaled every tile. l is kept as each lane's own
//   sum (its token columns), summed over the quad once at the end: no shuffles a tile. Every warp running the whole
//   tile's softmax was 4-7% slower at batches 8 and 32 (kernels/BENCHMARKS.md, session 47).
// - The values are widened once: Q . C^T widens the warp's codes into its B fragments (code x block scale in fp16)
//   and also stores them, 8 halves a lane, into the warp's own buffer, which P . C reads back transposed (ldmatrix
//   .trans) as its B fragments: warp w accumulates its 128 columns (16 n8 blocks) over the tile's tokens. (Widening
//   them again for P . C, as kernels/mla_decode_block_scaled.cu does, measured no faster than that kernel.)
// - REG_T 1: the widened B fragments stay in registers instead (64 a lane), each 8 x 8 matrix transposed by movmatrix
//   into P . C's: n8 block 2s + h of P . C is half h of k step s of Q . C^T. The same sums in the same order, so the
//   same bits; half the shared-memory traffic of the round trip (a movmatrix costs the shared-memory datapath one
//   cycle, as a 128-byte wavefront), but 224 registers, so 2 blocks an SM. The launcher takes it where the grid has
//   at most 2 blocks an SM anyway (batch 1, or short contexts): 4-7% faster there, 1-4% slower at 3 blocks an SM
//   (kernels/BENCHMARKS.md, session 47).
// - Warp 0 issues the copies after the second barrier of each tile: one bulk copy per page run of a tile (rows of a
//   page lie one after another) into the stage of the tile whose Q . C^T every warp has finished. (After the first
//   barrier its copies delayed the P blocks every warp waits for.)
// - The partials leave through shared memory as whole rows (16-byte stores of consecutive columns): stored from the
//   accumulators, each 4-byte store touched 8 rows (kernels/BENCHMARKS.md, session 46: batch 8 at 8k 11% faster).
// Rows are placed as they arrive (row r at r x 416 bytes, 8 banks apart), so the token order inside a tile is chosen
// for the loads instead: n8 block j's column n is row 8j + (n ^ (n >> 2 & 1)). Then Q . C^T's 8-byte loads (rows of a
// half warp) hit distinct banks.
//
// ELEM_E4M3 1, fp8_ds_mla (e4m3 codes, an fp32 scale per tile of 128 columns: warp w's columns are tile w, so each
// warp's values have one scale a token). The same definition as kernels/mla_decode_block_scaled.cu's for it: the
// codes widen exactly (cvt.rn.f16x2.e4m3x2) and the tile scales stay out of the MMAs.
// - Q . C^T: lane q loads 16 bytes a token for 4 k steps, columns 64c + 16q .. + 15 of the warp's; step 4c + i takes
//   columns 64c + 16q + 4i + (0, 1 | 2, 3) as logical k (2q, 2q+1 | 2q+8, 2q+9), and Q is loaded in that order. The
//   warp's partial score of token j is its scale_jw x its dot product.
// - P . C: warp w's P is multiplied by scale_jw / S_w (S_w the largest scale_jw of the split so far; its accumulator
//   is kept in units of S_w and rescaled by S_old / S_new when S_w grows, out = acc x S_w / l): in fp16 on the shared
//   P (P <= 2^8, the factor <= 1), or before P is rounded where every warp runs the softmax (m moves).
// - Rows are 656 bytes apart (16 modulo 128), so n8 block j's column n is row 8j + (n >> 1) + 4 (n & 1): the two rows
//   of a quarter warp's 16-byte loads are 4 apart, their 64-byte spans in distinct banks.
// - A row is 656 bytes: two stages, the scores and the widened tiles take 91 KB, so 2 blocks an SM (either build).
//
// E8M0 1, MX records (MXFP4 [256 e2m1 code bytes | 16 e8m0 | 64 k_pe] = 400 bytes; MXFP8, with ELEM_E4M3, [512 e4m3 |
// 16 e8m0 | 64 k_pe] = 656): warp w's columns are blocks 4w .. 4w + 3, and each warp takes E_jw, the largest of its
// 4 block exponents of token j, as that token's unit. Its widened values are code x 2^(e_b - E_jw) in fp16 (exact
// while e_b - E_jw >= -15 for e4m3, -17 for e2m1 with its 2^-6; a block further below rounds at 2^-24 of it), and
// 2^(E_jw - 127) is its scale of token j as fp8_ds_mla's tile scale above (the partial score's factor, P's / S_w).
// MXFP4's rows are 16 bytes apart modulo 128 and its code loads 8 bytes (a half warp: 4 rows of 32 bytes), so n8
// block j's column n is row 8j + 2 (n % 4) + n / 4 there.
//
// FP8_PE 1 (with ELEM_E4M3): kernels/mla_decode.py's plain FP8 cache, rows of 512 + 64 fp8 codes (e4m3, or e5m2 with
// FMT_E5M2) under one static scale (HAS_SCALE), its definition: s_j = sm_scale * scale * (q_latent . c_j + q_pe .
// pe_j), out = scale * sum_j p_j c_j. As ELEM_E4M3 without tile scales; k_pe's codes widen as the latent's (lane q:
// dims 4q .. 4q + 3 of the warp's 16) and q_pe is rounded to fp16 for its MMA. Rows are 576 bytes apart (64 modulo
// 128), so n8 block j's column n is row 8j + n: a quarter warp's two rows are adjacent, their spans 64 bytes apart.

#include "mla_fp8_common.cuh"

#ifndef ELEM_E4M3
#define ELEM_E4M3 0
#endif
#ifndef FP8_PE
#define FP8_PE 0
#endif
#ifndef E8M0
#define E8M0 0
#endif
#define TILE_SCALES (E8M0 || (ELEM_E4M3 && !FP8_PE))   // a scale a token a warp: fp8_ds_mla's, MX's 2^(E_jw - 127)
#define NWC 4                          // warps
#define NT (32 * NWC)
#define BN 32                          // tokens per tile
#define LAT_BYTES (ELEM_E4M3 ? LAT : LAT / 2)          // codes of a row (fp8, or e2m1 two a byte)
// fp32 tile scales (one a warp), none (FP8_PE: the static scale), or e4m3 block scales of a row
#define SCALE_BYTES (FP8_PE ? 0 : ELEM_E4M3 || E8M0 ? 16 : LAT / 16)
#define PE_OFF (LAT_BYTES + SCALE_BYTES)
#define PE_BYTES (FP8_PE ? ROPE : 2 * ROPE)
#define NROW (PE_OFF + PE_BYTES)       // 416 bytes a row (NVFP4), 656 (fp8_ds_mla, MXFP8), 400 (MXFP4), 576 (FP8_PE)
static_assert(!FP8_PE || (ELEM_E4M3 && !E8M0), "FP8_PE: fp8 codes, the static scale");
#define STAGE_BYTES (BN * NROW)
#define WCOL (LAT / NWC)               // latent columns of a warp
#define NPC (WCOL / 8)                 // its n8 blocks in P . C
#define RUN (PAGE < BN ? PAGE : BN)    // rows of one copy: a page's, or a tile's inside one page
#define NRUN (BN / RUN)                // copies a tile
#define SX_F4 (NWC * (BN / 8) * 32)    // partial scores of a tile: [warp][n8 block][lane] x 4
#define W_BYTES (BN * WCOL * 2)        // a warp's widened tile: [n8 block j][k step pair][lane q][row] x 16 bytes
static_assert(PAGE % BN == 0 || BN % PAGE == 0, "a tile is whole pages or inside one page");
static_assert(NRUN <= 32, "warp 0's lanes issue a tile's copies");
static_assert(BN / 8 == NWC, "warp w sums n8 block w's partials");
static_assert(!TILE_SCALES || WCOL == 128, "fp8_ds_mla: warp w's columns are scale tile w; MX: blocks 4w .. 4w + 3");

#ifndef HAS_SCALE
#define HAS_SCALE 0
#endif
#ifndef REG_T
#define REG_T 0
#endif
#define LAZY 8.f                       // how far (base 2) a score may pass the running maximum before it moves
static_assert(!(ELEM_E4M3 && !FP8_PE && !E8M0 && HAS_SCALE), "fp8_ds_mla's tile scales are the whole scale");

// The tile row of n8 block j's column n in Q . C^T (P's k index j / 2, n + 8 (j % 2) in P . C)
#if FP8_PE
__device__ __forceinline__ int tok_of(int j, int n) { return 8 * j + n; }
#elif E8M0 && !ELEM_E4M3
__device__ __forceinline__ int tok_of(int j, int n) { return 8 * j + 2 * (n & 3) + (n >> 2); }
#elif ELEM_E4M3
__device__ __forceinline__ int tok_of(int j, int n) { return 8 * j + (n >> 1) + 4 * (n & 1); }
#else
__device__ __forceinline__ int tok_of(int j, int n) { return 8 * j + (n ^ ((n >> 2) & 1)); }
#endif

// MX: 2^(e - top) for e8m0 bytes e <= top (a block's exponent, the warp's largest of the token) in fp16, twice:
// normal down to 2^-14, subnormal down to 2^-24, 0 below (the fp32 power of two rounded: exact to 2^-24, 0 from
// 2^-26; e - top is clamped at -30 first so that the fp32 exponent stays normal); an e8m0 byte's value 2^(e - 127),
// 255 NaN
__device__ __forceinline__ u32 pow2_h2(int e, int top) {
  return pack_half2_same(__int_as_float(max(e - top + 127, 97) << 23));
}
__device__ __forceinline__ int max_byte(u32 w) {
  return max(max((int)(w & 0xffu), (int)((w >> 8) & 0xffu)), max((int)((w >> 16) & 0xffu), (int)(w >> 24)));
}

__device__ __forceinline__ u32 movm(u32 a) {   // an 8 x 8 b16 matrix (one word a lane) transposed across the warp
  u32 d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}
__device__ __forceinline__ void bar_arrive_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void compute_sync() {   // the block's warps (named barrier 1; 0 is __syncthreads')
  asm volatile("bar.sync 1, %0;" :: "n"(NT) : "memory");
}
// the four 8 x 8 fp16 matrices at the rows the lanes point to (lanes 8i .. 8i + 7: matrix i), transposed: lane (g, q)
// gets rows 2q, 2q + 1 of column g of each
__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

extern "C" __global__ void __launch_bounds__(NT, CTAS) mla_latent_split_decode(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_pe, const u8* __restrict__ record,
    const int* __restrict__ block_table, const int* __restrict__ seq_lens, const float* __restrict__ static_scale,
    float* __restrict__ part_out, float* __restrict__ part_lse, double sm_scale_log2, int tokens_per_split,
    int num_heads, int s_lb, int s_lh, int s_pb, int s_ph, int s_rb, int s_tb, int s_ob, int s_oh, int s_os, int s_eb,
    int s_eh) {
  extern __shared__ __align__(128) u8 smem[];
  u8* tiles = smem;                                            // STAGES x STAGE_BYTES
  F4* sx = (F4*)(smem + STAGES * STAGE_BYTES);                 // 2 x SX_F4 partial scores
#if REG_T
  unsigned long long* landed = (unsigned long long*)(sx + 2 * SX_F4);
#else
  u8* widened = (u8*)(sx + 2 * SX_F4);                         // NWC x W_BYTES
  unsigned long long* landed = (unsigned long long*)(widened + NWC * W_BYTES);
#endif

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  MLA_SPLIT_SPAN;

  if (tid == 0) {
    for (int st = 0; st < STAGES; ++st)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(landed + st)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // The copies (warp 0). Lane l holds the page of run 32 k + l of this split (a group of 32 runs; the next group is
  // loaded while this one is copied, so no copy waits for the block table); a tile's runs are copied by lanes
  // 0 .. NRUN - 1. Rows past the split's end are zeroed instead (a stale or NaN row never reaches the sums: P is 0
  // there, and 0 x NaN would not be), before the arrival that publishes them.
  auto page_of = [&](int run) -> int {
    const int tok = start + run * RUN;
    return tok < end ? block_table[b * s_tb + tok / PAGE] : 0;
  };
  int cur = 0, nxt = 0;
  auto issue = [&](int t) {
    const int st = t % STAGES, run0 = t * NRUN;
    if (run0 % 32 == 0 && t > 0) {
      cur = nxt;
      nxt = page_of(run0 + 32 + lane);
    }
    const int page = __shfl_sync(0xffffffffu, cur, (run0 + lane) % 32);
    u8* stage = tiles + st * STAGE_BYTES;
    const int t0 = start + t * BN, rows = min(BN, end - t0);
    for (int ch = rows * (NROW / 16) + lane; ch < BN * (NROW / 16); ch += 32) ((U4*)stage)[ch] = U4{0u, 0u, 0u, 0u};
    __syncwarp();
    const u32 bar = smem_addr(landed + st);
    if (lane == 0) bar_arrive_tx(bar, rows * NROW);
    __syncwarp();
    const int r0 = lane * RUN, n = min(RUN, rows - r0);
    if (lane < NRUN && n > 0)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(smem_addr(stage + r0 * NROW)),
                      "l"(record + (i64)page * s_rb + (i64)((t0 + r0) % PAGE) * NROW), "r"(n * NROW), "r"(bar)
                   : "memory");
  };
  if (warp == 0) {
    cur = page_of(lane);
    nxt = page_of(32 + lane);
    for (int t = 0; t < min(STAGES, n_tiles); ++t) issue(t);
  }

#if HAS_SCALE
  const float scale = *static_scale;
#else
  const float scale = 1.f;
#endif
  const float widening = ELEM_E4M3 ? 1.f : 64.f;   // 2^6: the e2m1 widening's
  const float qk_lat = (float)sm_scale_log2 * scale * widening;
  const float qk_pe = (float)sm_scale_log2 * (FP8_PE ? scale : 1.f);   // FP8_PE: k_pe's codes under the scale too
  const float out_scale = scale * widening;
  const int h0 = hb * 16 + g, h1 = h0 + 8;

  // Q's A fragments in registers. Latent k step s (of this warp's 8) takes 4 values of block 4 (s / 4) + q of the
  // warp's 8: columns 128w + 64 (s / 4) + 16q + o + (0, 2 | 1, 3), o = 4 (s % 4), in fp16 (the order the widening
  // yields, kernels/mla_decode_block_scaled.cu; e4m3: (0, 1 | 2, 3), the header); the k_pe step takes dims 16w + 4q
  // .. + 3 as stored, as logical k (2q, 2q + 1 | 2q + 8, 2q + 9), so a lane reads 8 consecutive bytes of a k_pe row.
  u32 qa[8][4], qp[4];
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const int col = WCOL * warp + 64 * (s >> 2) + 16 * q + 4 * (s & 3);
    const u32x2 v0 = h0 < num_heads ? *(const u32x2*)(q_lat + b * s_lb + (i64)h0 * s_lh + col) : u32x2{0u, 0u};
    const u32x2 v1 = h1 < num_heads ? *(const u32x2*)(q_lat + b * s_lb + (i64)h1 * s_lh + col) : u32x2{0u, 0u};
#if ELEM_E4M3
    qa[s][0] = half2_of(v0.x);
    qa[s][1] = half2_of(v1.x);
    qa[s][2] = half2_of(v0.y);
    qa[s][3] = half2_of(v1.y);
#else
    qa[s][0] = half2_of(prmt(v0.x, v0.y, 0x5410));
    qa[s][1] = half2_of(prmt(v1.x, v1.y, 0x5410));
    qa[s][2] = half2_of(prmt(v0.x, v0.y, 0x7632));
    qa[s][3] = half2_of(prmt(v1.x, v1.y, 0x7632));
#endif
  }
  {
    const int col = 16 * warp + 4 * q;
    const u32x2 v0 = h0 < num_heads ? *(const u32x2*)(q_pe + b * s_pb + (i64)h0 * s_ph + col) : u32x2{0u, 0u};
    const u32x2 v1 = h1 < num_heads ? *(const u32x2*)(q_pe + b * s_pb + (i64)h1 * s_ph + col) : u32x2{0u, 0u};
#if FP8_PE
    qp[0] = half2_of(v0.x); qp[1] = half2_of(v1.x); qp[2] = half2_of(v0.y); qp[3] = half2_of(v1.y);
#else
    qp[0] = v0.x; qp[1] = v1.x; qp[2] = v0.y; qp[3] = v1.y;
#endif
  }
  const u32 sel_q = q | (q << 4) | 0x4400u;   // byte q of a word, twice (an e4m3x2 pair of one scale)
  const int code0 = (LAT_BYTES / NWC) * warp, scale0 = LAT_BYTES + (SCALE_BYTES / NWC) * warp;
  const int pe0 = PE_OFF + (PE_BYTES / NWC) * warp;
#if !REG_T
  u8* mine = widened + warp * W_BYTES;
  // The widened tile: the B fragments of k steps 2p and 2p + 1 of n8 block j, lane (g, q) (4 words: 8 halves), are
  // row g of the 8 x 8 matrix (j, p, q), placed at 512 (4j + p) + 128q + 16 (g ^ 2q) bytes (8 lanes of a store or
  // of a matrix hit 8 different 16-byte bank groups). Its 8 columns are latent columns 64 (p / 2) + 16q + 8 (p % 2)
  // + (0, 2, 1, 3, 4, 6, 5, 7) of the warp's (e4m3: + 0 .. 7).
  const u32 w_store = smem_addr(mine) + 128 * q + 16 * (g ^ (2 * q));
#endif

  // Q . C^T of a tile over this warp's columns, scaled to base 2, into `out` as [warp][n8 block][lane]; the widened
  // values into the warp's buffer (REG_T: transposed into wt, [k step s][half h][n8 block j]). TILE_SCALES: the
  // warp's scales of this lane's columns (n8 block j's 2q + e) into tsc, read again by P . C (the stage is reused
  // before it).
  u32 wt[REG_T ? 8 : 1][2][BN / 8];
  float tsc[BN / 8][2];
  auto score_tile = [&](const u8* tile, F4* out) {
    float acc[BN / 8][2][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int p = 0; p < 2; ++p) acc[j][p][0] = acc[j][p][1] = acc[j][p][2] = acc[j][p][3] = 0.f;
#if E8M0
    // the warp's 4 block exponents of row tok_of(j, g), their largest E (the token's unit here: tsc 2^(E - 127),
    // the widened values code x 2^(e_b - E)); tsc of this lane's columns from the lanes whose row they are
    u32 mxw[BN / 8];
    int mxe[BN / 8];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      mxw[j] = *(const u32*)(tile + tok_of(j, g) * NROW + scale0);
      mxe[j] = max_byte(mxw[j]);
      const float mine = e8m0_value(mxe[j]);
      tsc[j][0] = __shfl_sync(0xffffffffu, mine, 4 * (2 * q));
      tsc[j][1] = __shfl_sync(0xffffffffu, mine, 4 * (2 * q + 1));
    }
    // the factor of this lane's block of k step group c (columns 64c + 16q .. + 15: block 2c + q / 2) in f16x2
    auto mx_factor = [&](int j, int c) { return pow2_h2((int)prmt(mxw[j], 0u, 0x4440u | (2 * c + (q >> 1))), mxe[j]); };
#elif TILE_SCALES
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      tsc[j][0] = *(const float*)(tile + tok_of(j, 2 * q) * NROW + scale0);
      tsc[j][1] = *(const float*)(tile + tok_of(j, 2 * q + 1) * NROW + scale0);
    }
#endif
#if ELEM_E4M3
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      U4 cw[BN / 8];
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) cw[j] = *(const U4*)(tile + tok_of(j, g) * NROW + code0 + 64 * c + 16 * q);
#pragma unroll
      for (int kp = 0; kp < 2; ++kp)
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const u32 w0 = kp ? cw[j].z : cw[j].x, w1 = kp ? cw[j].w : cw[j].y;
#if E8M0
          const u32 f = mx_factor(j, c);
          const U4 v = {hmul2(widen2(w0), f), hmul2(widen2_hi(w0), f), hmul2(widen2(w1), f), hmul2(widen2_hi(w1), f)};
#else
          const U4 v = {widen2(w0), widen2_hi(w0), widen2(w1), widen2_hi(w1)};
#endif
#else
#if !E8M0
    u32x2 sw[BN / 8];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) sw[j] = *(const u32x2*)(tile + tok_of(j, g) * NROW + scale0);
#endif
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      u32x2 cw[BN / 8];
      u32 s2[BN / 8];
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        cw[j] = *(const u32x2*)(tile + tok_of(j, g) * NROW + code0 + 32 * c + 8 * q);
#if E8M0
        s2[j] = mx_factor(j, c);
#else
        s2[j] = widen2(prmt(c ? sw[j].y : sw[j].x, 0u, sel_q));
#endif
      }
#pragma unroll
      for (int kp = 0; kp < 2; ++kp)
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const u32 w = kp ? cw[j].y : cw[j].x;
          const u32 lo = e4m3_of_low(w), hi = e4m3_of_high(w);
          const U4 v = {hmul2(widen2(lo), s2[j]), hmul2(widen2(hi), s2[j]), hmul2(widen2_hi(lo), s2[j]),
                        hmul2(widen2_hi(hi), s2[j])};
#endif
          mma16816(acc[j][0], qa[4 * c + 2 * kp], v.x, v.y);
          mma16816(acc[j][0], qa[4 * c + 2 * kp + 1], v.z, v.w);
#if REG_T
          wt[4 * c + 2 * kp][0][j] = movm(v.x);
          wt[4 * c + 2 * kp][1][j] = movm(v.y);
          wt[4 * c + 2 * kp + 1][0][j] = movm(v.z);
          wt[4 * c + 2 * kp + 1][1][j] = movm(v.w);
#else
          asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
                       :: "r"(w_store + 512 * (4 * j + 2 * c + kp)), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                       : "memory");
#endif
        }
    }
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#if FP8_PE
      const u32 pe = *(const u32*)(tile + tok_of(j, g) * NROW + pe0 + 4 * q);   // dims 4q .. 4q + 3 of the warp's
      mma16816(acc[j][1], qp, widen2(pe), widen2_hi(pe));
#else
      const u32x2 pe = *(const u32x2*)(tile + tok_of(j, g) * NROW + pe0 + 8 * q);
      mma_pe(acc[j][1], qp, pe.x, pe.y);
#endif
    }
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#if TILE_SCALES
      const float k0 = qk_lat * tsc[j][0], k1 = qk_lat * tsc[j][1];
#else
      const float k0 = qk_lat, k1 = qk_lat;
#endif
      out[(warp * (BN / 8) + j) * 32 + lane] = F4{k0 * acc[j][0][0] + qk_pe * acc[j][1][0],
                                                  k1 * acc[j][0][1] + qk_pe * acc[j][1][1],
                                                  k0 * acc[j][0][2] + qk_pe * acc[j][1][2],
                                                  k1 * acc[j][0][3] + qk_pe * acc[j][1][3]};
    }
  };

  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};   // rows g and g + 8; l: this lane's columns' sum
  float s_run = 0.f;   // TILE_SCALES: the warp's largest token scale of the split so far, the accumulator's unit
  // o: n8 block 4 q' + p: matrix column n is latent column 64 (p / 2) + 16 q' + 8 (p % 2) + perm(n) (fp8 codes: + n);
  // REG_T: n8 block 2s + h: column n is 64 (s / 4) + 4 (s % 4) + 16 (n / 2) + (0, 2 | 1, 3) (half h; Q's k order;
  // fp8 codes: + 2h + n % 2)
  float o[NPC][4];
#pragma unroll
  for (int n = 0; n < NPC; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
#if !REG_T
  // P . C's matrices: lanes 8i .. 8i + 7 point at the rows of matrix i of an ldmatrix: (j = 2jj + i % 2, p, q' =
  // 2 x pair + i / 2) for n8 blocks 4 q' + p
  const int li = lane >> 3, lr = lane & 7;
  u32 ld_base[2];
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    const int qq = 2 * pair + (li >> 1);
    ld_base[pair] = smem_addr(mine) + 2048 * (li & 1) + 128 * qq + 16 * (lr ^ (2 * qq));   // j = 2jj + li % 2
  }
#endif

  // Phase t: the softmax and P . C of tile t, then Q . C^T of tile t + 1 (it overwrites the widened tile P . C read).
  // Warp w's P block goes to slot [(w + 1) % 4][w] of the partials, which only warp w reads: {P of row g, P of row g +
  // 8 (fp16 pairs), this lane's sum of each (the first -1 when the warp saw a score that moves m)}.
  if (n_tiles > 0) {
    wait_parity(smem_addr(landed), 0);
    score_tile(tiles, sx);
  }
  for (int t = 0; t < n_tiles; ++t) {
    compute_sync();   // every warp's partials of tile t are in, and every warp's Q . C^T of tile t is done
    F4* part = sx + (t & 1) * SX_F4;
    const int t0 = start + t * BN;
    {   // warp w sums n8 block w's four partials (in warp order) into its own slot [w][w], and its P block against m
      const F4 a = part[warp * 32 + lane], c = part[((BN / 8) + warp) * 32 + lane];
      const F4 d = part[(2 * (BN / 8) + warp) * 32 + lane], e = part[(3 * (BN / 8) + warp) * 32 + lane];
      const F4 s = F4{((a.x + c.x) + d.x) + e.x, ((a.y + c.y) + d.y) + e.y, ((a.z + c.z) + d.z) + e.z,
                      ((a.w + c.w) + d.w) + e.w};
      part[(warp * (BN / 8) + warp) * 32 + lane] = s;
      float v[4] = {s.x, s.y, s.z, s.w};
      if (t0 + BN > end) {
#pragma unroll
        for (int k = 0; k < 4; ++k)   // (e is the fourth partial here)
          if (t0 + tok_of(warp, 2 * q + (k & 1)) >= end) v[k] = NEG_INF;
      }
      const bool moves = t == 0 || v[0] > m[0] + LAZY || v[1] > m[0] + LAZY || v[2] > m[1] + LAZY ||
                         v[3] > m[1] + LAZY;
      const float p0 = ex2(v[0] - m[0]), p1 = ex2(v[1] - m[0]), p2 = ex2(v[2] - m[1]), p3 = ex2(v[3] - m[1]);
      part[(((warp + 1) & 3) * (BN / 8) + warp) * 32 + lane] =
          F4{__uint_as_float(pack_half2(p0, p1)), __uint_as_float(pack_half2(p2, p3)),
             __any_sync(0xffffffffu, moves) ? -1.f : p0 + p1, p2 + p3};
    }
    compute_sync();
    if (warp == 0 && t + STAGES < n_tiles) issue(t + STAGES);   // into tile t's stage
    u32 pa[BN / 16][4];
    F4 pb[BN / 8];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) pb[j] = part[(((j + 1) & 3) * (BN / 8) + j) * 32 + lane];
#if TILE_SCALES
    // P's factors scale_jw / S_w (the header); S_w grows to the tile's largest (fmaxf passes over a NaN scale, whose
    // score and P are NaN anyway); a split whose scales are all 0 so far has only zeros in its accumulator
    float fac[BN / 8][2];
    {
      float mx = fmaxf(fmaxf(fmaxf(tsc[0][0], tsc[0][1]), fmaxf(tsc[1][0], tsc[1][1])),
                       fmaxf(fmaxf(tsc[2][0], tsc[2][1]), fmaxf(tsc[3][0], tsc[3][1])));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));   // the quad's lanes hold all 32 columns
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if (mx > s_run) {   // (the same at every lane)
        const float f = s_run / mx;
#pragma unroll
        for (int n = 0; n < NPC; ++n) {
          o[n][0] *= f; o[n][1] *= f; o[n][2] *= f; o[n][3] *= f;
        }
        s_run = mx;
      }
      const float inv = s_run > 0.f ? 1.f / s_run : 0.f;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        fac[j][0] = tsc[j][0] * inv;
        fac[j][1] = tsc[j][1] * inv;
      }
    }
#endif
    if (pb[0].z < 0.f || pb[1].z < 0.f || pb[2].z < 0.f || pb[3].z < 0.f) {   // m moves: every warp, the four sums
      float sc[BN / 8][4];
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const F4 v = part[(j * (BN / 8) + j) * 32 + lane];
        sc[j][0] = v.x; sc[j][1] = v.y; sc[j][2] = v.z; sc[j][3] = v.w;
      }
      if (t0 + BN > end) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (t0 + tok_of(j, 2 * q + (e & 1)) >= end) sc[j][e] = NEG_INF;
      }
#if TILE_SCALES
      online_softmax<BN, NPC, true, true>(sc, m, l, o, pa, fac);
#else
      online_softmax<BN, NPC, false, true>(sc, m, l, o, pa);
#endif
    } else {
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
#if TILE_SCALES
        const u32 f = pack_half2(fac[j][0], fac[j][1]);
        pa[j >> 1][2 * (j & 1)] = hmul2(__float_as_uint(pb[j].x), f);
        pa[j >> 1][2 * (j & 1) + 1] = hmul2(__float_as_uint(pb[j].y), f);
#else
        pa[j >> 1][2 * (j & 1)] = __float_as_uint(pb[j].x);
        pa[j >> 1][2 * (j & 1) + 1] = __float_as_uint(pb[j].y);
#endif
      }
      l[0] += ((pb[0].z + pb[1].z) + pb[2].z) + pb[3].z;
      l[1] += ((pb[0].w + pb[1].w) + pb[2].w) + pb[3].w;
    }

#if REG_T
    // P . C: n8 block 2s + h from the transposed fragments of k step s's half h
#pragma unroll
    for (int jj = 0; jj < BN / 16; ++jj)
#pragma unroll
      for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h) mma16816(o[2 * s + h], pa[jj], wt[s][h][2 * jj], wt[s][h][2 * jj + 1]);
#else
    // P . C: the widened tile read back transposed, two n8 blocks an ldmatrix
    __syncwarp();
#pragma unroll
    for (int jj = 0; jj < BN / 16; ++jj)
#pragma unroll
      for (int p = 0; p < 4; ++p)
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {
          u32 r[4];
          ldsm_x4_trans(ld_base[pair] + 512 * (8 * jj + p), r);
          mma16816(o[4 * (2 * pair) + p], pa[jj], r[0], r[1]);
          mma16816(o[4 * (2 * pair + 1) + p], pa[jj], r[2], r[3]);
        }
    __syncwarp();
#endif

    if (t + 1 < n_tiles) {
      wait_parity(smem_addr(landed + (t + 1) % STAGES), ((t + 1) / STAGES) & 1);
      score_tile(tiles + ((t + 1) % STAGES) * STAGE_BYTES, sx + ((t + 1) & 1) * SX_F4);
    }
  }

  // Partials: out = out_scale * acc / l (0 for an empty split), lse2 = m + log2(l) (-inf for an empty split), staged
  // as [16 heads][516 floats] over the tiles and score buffers (every warp is past its last P . C) for whole-row
  // stores: lane (g, q) holds columns n = 2q, 2q + 1 of each n8 block (o's comment says which latent columns).
#pragma unroll
  for (int x = 1; x < 4; x *= 2) {   // l over the quad's columns
    l[0] += __shfl_xor_sync(0xffffffffu, l[0], x);
    l[1] += __shfl_xor_sync(0xffffffffu, l[1], x);
  }
#if TILE_SCALES
  const float unit = out_scale * s_run;
#else
  const float unit = out_scale;
#endif
  const float f0 = l[0] == 0.f ? 0.f : unit / l[0], f1 = l[1] == 0.f ? 0.f : unit / l[1];
  static_assert(16 * (LAT + 4) * 4 <= STAGES * STAGE_BYTES + 2 * SX_F4 * 16 + (REG_T ? 0 : NWC * W_BYTES),
                "the staged partials fit in the tiles, scores and widened tiles");
  compute_sync();
  float* stage = (float*)smem;
  float* row0 = stage + g * (LAT + 4) + WCOL * warp;
  float* row1 = row0 + 8 * (LAT + 4);
#if REG_T
#pragma unroll
  for (int s = 0; s < 8; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int base = 64 * (s >> 2) + 4 * (s & 3) + 16 * q + (ELEM_E4M3 ? 2 * h : h), next = ELEM_E4M3 ? 1 : 2;
      const float* v = o[2 * s + h];
      row0[base] = v[0] * f0;
      row0[base + next] = v[1] * f0;
      row1[base] = v[2] * f1;
      row1[base + next] = v[3] * f1;
    }
#else
  // perm(2q), perm(2q + 1)
  const int c0 = ELEM_E4M3 ? 2 * q : (q & 1) + 4 * (q >> 1), c1 = ELEM_E4M3 ? c0 + 1 : c0 + 2;
#pragma unroll
  for (int qq = 0; qq < 4; ++qq)
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int base = 64 * (p >> 1) + 16 * qq + 8 * (p & 1);
      const float* v = o[4 * qq + p];
      row0[base + c0] = v[0] * f0;
      row0[base + c1] = v[1] * f0;
      row1[base + c0] = v[2] * f1;
      row1[base + c1] = v[3] * f1;
    }
#endif
  if (warp == 0 && q == 0) {
    if (h0 < num_heads) part_lse[b * s_eb + (i64)h0 * s_eh + split] = l[0] == 0.f ? NEG_INF : m[0] + log2f(l[0]);
    if (h1 < num_heads) part_lse[b * s_eb + (i64)h1 * s_eh + split] = l[1] == 0.f ? NEG_INF : m[1] + log2f(l[1]);
  }
  compute_sync();
#pragma unroll 4
  for (int e = tid; e < 16 * LAT / 4; e += NT) {
    const int n = e / (LAT / 4), c4 = e % (LAT / 4), head = hb * 16 + n;
    if (head < num_heads)
      *(F4*)(part_out + b * s_ob + (i64)head * s_oh + (i64)split * s_os + 4 * c4) =
          *(const F4*)(stage + n * (LAT + 4) + 4 * c4);
  }
}
