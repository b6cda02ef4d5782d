// MLA decode over a paged block-scaled latent with k_pe beside it in the query's 16-bit type, split-KV: the CUDA kernel
// of kernels/decode_attention_block_scaled.py's mla_decode_block_scaled(..., impl="cuda") (compiled at first use by
// NVRTC, kernels/nvrtc.py; sm_90: bulk copies). Latent layouts, by ELEM_E4M3 (codes) x SCALES (block scales):
// - NVFP4 (0, 0): e2m1 values, an e4m3 scale per 16, an optional fp32 static scale;
// - vLLM's fp8_ds_mla (1, 1; FlashMLA's sparse cache): e4m3 values, an fp32 scale per tile of 128;
// - MXFP4 (0, 2) and MXFP8 (1, 2): e2m1 / e4m3 values, an e8m0 scale per 32.
// Defines: NW warps, NB n8 token blocks a warp, STAGES tiles in flight, MT m16 head tiles, CTAS blocks per SM (launch
// bounds), PAGE page size, TILE_BYTES, Q_BF16, HAS_SCALE, ELEM_E4M3, SCALES, RECORD (a row's codes, scales and k_pe
// are one record in memory: one bulk copy a row).
//
// The definition of reference.mla_decode_block_scaled: s_j = sm_scale * (scale * q_latent . c_j + q_pe . pe_j),
// out = sum_j softmax(s)_j scale c_j (latent space), with c_j = code x its block's scale. Here q_latent is rounded to
// fp16, scores and accumulation in fp32, online softmax in base 2 with P rounded to fp16 for P . C; q_pe . pe_j is an
// MMA in the query's own type (bf16 or fp16: both operands exact). out = acc / l and lse2 = m + log2(l) per split;
// kernels/splits.merge_splits combines the splits.
//
// The tile pipeline, the score exchange between warps and the online softmax are kernels/mla_decode_fp8.cu's (read
// its header): warps split a tile's tokens for Q . C^T and the latent columns for P . C, both mma.sync.m16n8k16.
// What differs is how the stored values reach the MMA fragments, each widened in registers from the tile:
// - A tile row is [codes | block scales | 64 k_pe values] (NVFP4 256 + 32 + 128 = 416 bytes, fp8_ds_mla 512 + 16 +
//   128 = 656, vLLM's record, MXFP8 the same, MXFP4 256 + 16 + 128 = 400; three bulk copies from three paged
//   tensors, or one from a record), rows placed by tile_at() so that both products' loads are bank-conflict free.
// e2m1 codes (NVFP4, MXFP4):
// - e2m1 -> fp16: each value widened exactly into fp16 (code x block scale has at most 5 significant bits, and its
//   smallest, 2^-16, is an fp16 subnormal). A word's low nibbles become e4m3 bytes of value x 2^-6 (s e1 e0 m -> s 0
//   e1 e0 m 0 0), its high nibbles likewise, then cvt.rn.f16x2.e4m3x2 (kernels/gqa_decode_block_scaled.cu); the 2^6
//   goes into the softmax and output scales. The block scale multiplies each f16x2 pair (exact).
// - Q . C^T: lane q of a k step takes 4 values of block 4c + q (a lane's 8 bytes hold one block: one scale); the
//   widening yields the even values' pair and the odd values' pair, so logical k (2q, 2q+1 | 2q+8, 2q+9) is values
//   (o, o+2 | o+1, o+3) of the block, o = 4 x (step % 4), and Q is stored in that order (one 16-byte load a step).
// - P . C: a lane needs two consecutive tokens of one latent column. It loads a word (8 columns) of each of 4 tokens
//   and interleaves two tokens' e4m3 bytes with a byte permute before widening, so each pair holds one column of
//   two tokens; the 8 columns become 8 different n8 blocks (block 8m + e holds columns colbase + 64m + 8n + e), and
//   the store puts them back in place: a lane's c0 of blocks 8m .. 8m + 7 are 8 consecutive columns.
// e4m3 codes (ELEM_E4M3) widen exactly (cvt.rn.f16x2.e4m3x2):
// - Q . C^T: lane q of k steps 2c, 2c + 1 loads 8 bytes, columns 32c + 8q .. + 7; step 2c + kk takes columns
//   32c + 8q + 4kk + (0, 1 | 2, 3) as logical k (2q, 2q+1 | 2q+8, 2q+9), and Q is stored in that order.
// - P . C: a lane loads 8 columns (8 bytes) of tokens r0, r0 + 1, r0 + 8, r0 + 9 and sorts even and odd columns with
//   a byte permute; then as NVFP4's.
// fp8_ds_mla's tile scales (SCALES 1) stay out of the MMAs. Each latent tile t (steps 8t .. 8t + 7) has its own
// Q . C^T accumulator; s_j = sum_t scale_jt x dot_jt in fp32. Warp w's P . C columns are tile w (4 warps x 128): P's
// column j is multiplied by scale_jw / S_w before it is rounded to fp16, S_w the largest scale_jw of the split so far,
// so P stays <= 1 and the accumulator is kept in units of S_w (rescaled by S_old / S_new when it grows; out = acc x
// S_w / l).
// e8m0 scales (SCALES 2, MX), as kernels/gqa_decode_block_scaled.cu takes them: with E_j token j's largest block
// exponent, the tile holds code x 2^(e_jb - E_j) in fp16 (pow2_h: exact while that is an fp16, e.g. e_jb - E_j >= -17
// for e2m1 with the 2^-6 above; a block further below its token's largest rounds at 2^-24 of it), the score takes
// 2^(E_j - 127), and P's column j 2^(E_j - E_run) (E_run the largest E_j so far, the accumulator's unit: its
// rescales are exact). Every warp reads every token's E_j from shared memory (`ex`, written with the scores).

#include "mla_fp8_common.cuh"

#ifndef ELEM_E4M3
#define ELEM_E4M3 0                    // the codes: 0 e2m1 (two a byte), 1 e4m3
#endif
#ifndef SCALES
#define SCALES 0                       // the block scales: 0 e4m3 per 16, 1 fp32 per tile of 128, 2 e8m0 per 32
#endif
#define TILE_FP8 (SCALES == 1)
#define E8M0 (SCALES == 2)
#define LAT_BYTES (ELEM_E4M3 ? LAT : LAT / 2)          // codes of a row
#define SCALE_BYTES (SCALES == 0 ? LAT / 16 : 16)      // block scales of a row
#define PE_OFF (LAT_BYTES + SCALE_BYTES)
#define NROW (PE_OFF + 2 * ROPE)       // bytes of a tile row: 416 (NVFP4), 656 (fp8_ds_mla, MXFP8), 400 (MXFP4)
#define PADDED (NROW % 128 == 16)      // rows 16 bytes apart modulo 128: tile_at's pad table
#define NT (NW * 32)
#define BN (NW * NB * 8)               // tokens per tile
#define NPC (LAT / (8 * NW))           // n8 latent blocks per warp in P . C
#define HB (16 * MT)                   // heads per block
#define TPR (NT >= BN ? NT / BN : 1)   // threads per tile row (the copy, the zeroing)
#define SX_FLOATS (NW * 32 * MT * NB * 4)
#define KSTEPS (LAT / 16 + ROPE / 16)  // 32 latent k steps, then 4 of k_pe
#if PADDED
#define NSTAGE_BYTES (BN * NROW + 384 * (BN / 8))
#else
#define NSTAGE_BYTES (BN * NROW + 32 * (BN / 8) + 32)
#endif
#ifndef HAS_SCALE
#define HAS_SCALE 0
#endif
#ifndef RECORD
#define RECORD 0
#endif
static_assert(BN % 16 == 0, "P . C takes k steps of 16 tokens");
static_assert(NPC % 8 == 0, "P . C takes the latent columns in groups of 64 a warp");
static_assert(NROW % 128 == 16 || NROW % 128 == 32, "tile_at places rows 16 or 32 bytes apart modulo 128");
static_assert(SCALES == 0 || (NW == 4 && BN == 32),
              "fp8_ds_mla: warp w's columns are tile w; fp32 and e8m0 scales: tile row r is lane r's");
static_assert(SCALES != 0 || !ELEM_E4M3, "e4m3 scales over e4m3 codes are not exact in fp16");

#if PADDED
// Row r at r x NROW bytes (16 mod 128: 656 is 164 words, 400 is 100, both 4 mod 32) plus a pad by r mod 8 (0, 16, 32, 48, 96, 176, 256, 336 bytes: 5 bits
// a row, in 16-byte units) and 384 bytes every 8 rows: row r then starts 32 x ((r & 3) ^ ((r >> 2) & 1)) bytes into
// a 128-byte line, so that within any 8 aligned rows, rows 0-3, rows 4-7, the even and the odd rows each start in four
// different 8-bank groups: Q . C^T's 8-byte loads (rows g of a half warp) and P . C's (rows 2q, or 2q + 1) hit
// distinct banks.
__device__ __forceinline__ int tile_at(int row, int byte) {
  return row * NROW + 16 * (int)((0xAC16618820ull >> (5 * (row & 7))) & 31) + 384 * (row >> 3) + byte;
}
#else
// Row r at r x 416 bytes (104 words, 8 mod 32), plus 32 bytes where bit 2 of r is set, plus 32 bytes every 8 rows (so
// that a shifted row 8k + 7 never overlaps row 8k + 8): within any 8 aligned rows, rows 0-3, rows 4-7, the even and
// the odd rows each start in four different 8-bank groups, so Q . C^T's 8-byte loads (rows g of a half warp) and
// P . C's 4-byte loads (rows 2q, or 2q + 1, of 8 aligned rows) hit distinct banks.
__device__ __forceinline__ int tile_at(int row, int byte) {
  return row * NROW + 32 * ((row >> 2) & 1) + 32 * (row >> 3) + byte;
}
#endif

__device__ __forceinline__ void bulk(u32 bar, u32 dst, const u8* src, int bytes) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// e8m0 (MX): 2^d in fp16 bits for d <= 0 (a block's exponent less its token's largest): normal down to 2^-14,
// subnormal down to 2^-24, 0 below
__device__ __forceinline__ u32 pow2_h(int d) { return d >= -14 ? (u32)(d + 15) << 10 : d >= -24 ? 1u << (d + 24) : 0u; }
// 2^d in fp32 for d <= 127 (subnormals included, 0 below 2^-149)
__device__ __forceinline__ float pow2f(int d) {
  return d >= -126 ? __int_as_float((d + 127) << 23) : d >= -149 ? __int_as_float(1 << (d + 149)) : 0.f;
}

extern "C" __global__ void __launch_bounds__(NT, CTAS) mla_block_scaled_decode(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_pe, const u8* __restrict__ codes,
    const u8* __restrict__ scales, const u8* __restrict__ k_pe, const int* __restrict__ block_table,
    const int* __restrict__ seq_lens, const float* __restrict__ static_scale,
    float* __restrict__ part_out, float* __restrict__ part_lse, double sm_scale_log2,
    int tokens_per_split, int num_heads,
    int s_lb, int s_lh, int s_pb, int s_ph, int s_cb, int s_cs, int s_sb, int s_ss, int s_eb_pe, int s_es_pe,
    int s_tb, int s_ob, int s_oh, int s_os, int s_eb, int s_eh) {
  extern __shared__ __align__(128) u8 smem[];
  u8* tiles = smem;                                   // STAGES x NSTAGE_BYTES
  U4* qs = (U4*)(smem + TILE_BYTES);                  // [KSTEPS][MT][32 lanes] A fragments
  float* sx = (float*)(qs + KSTEPS * MT * 32);        // 2 x [NW][32 lanes][MT][NB] x 4 scores
  int* ex = (int*)(sx + 2 * SX_FLOATS);               // 2 x [BN] e8m0: each tile row's largest block exponent
  unsigned long long* bars = (unsigned long long*)(ex + 2 * BN);   // one mbarrier per stage

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  MLA_SPLIT_SPAN;
#if HAS_SCALE
  const float scale = *static_scale;
#else
  const float scale = 1.f;
#endif
#if ELEM_E4M3
  const float widening = 1.f;
#else
  const float widening = 64.f;   // 2^6: the e2m1 widening's
#endif
  const float qk_lat = (float)sm_scale_log2 * scale * widening;
  const float qk_pe = (float)sm_scale_log2;
  const float out_scale = scale * widening;

  // Tile row t of this split: its page's slot (page index x PAGE + slot), -1 past the split's end. Loaded one tile
  // ahead, so the copies never wait for the block table.
  const int my_row = tid / TPR;
  auto row_slot = [&](int t) -> i64 {
    const int tok = start + t * BN + my_row;
    if (t >= n_tiles || tok >= end) return -1;
    return (i64)block_table[b * s_tb + tok / PAGE] * PAGE + tok % PAGE;
  };
  auto load_tile = [&](i64 slot, int st) {
    u8* stage = tiles + st * NSTAGE_BYTES;
    if (tid % TPR == 0) {   // the stage's mbarrier counts BN arrivals and the bytes of the valid rows
      const u32 bar = smem_addr(bars + st);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(slot >= 0 ? NROW : 0)
                   : "memory");
      if (slot >= 0) {
        const i64 page = slot / PAGE, in = slot % PAGE;
#if RECORD   // codes, scales and k_pe one record (vLLM's fp8_ds_mla byte record): one copy a row
        bulk(bar, smem_addr(stage + tile_at(my_row, 0)), codes + page * s_cb + in * s_cs, NROW);
#else
        bulk(bar, smem_addr(stage + tile_at(my_row, 0)), codes + page * s_cb + in * s_cs, LAT_BYTES);
        bulk(bar, smem_addr(stage + tile_at(my_row, LAT_BYTES)), scales + page * s_sb + in * s_ss, SCALE_BYTES);
        bulk(bar, smem_addr(stage + tile_at(my_row, PE_OFF)), k_pe + page * s_eb_pe + in * s_es_pe, 2 * ROPE);
#endif
      }
    }
    if (slot < 0)   // zeros: a stale or NaN slot never reaches the sums (P is 0 there, and 0 x NaN would not be)
      for (int ch = tid % TPR; ch < NROW / 16; ch += TPR) *(U4*)(stage + tile_at(my_row, 16 * ch)) = U4{0u, 0u, 0u, 0u};
  };
  if (tid == 0) {
    for (int st = 0; st < STAGES; ++st)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bars + st)), "r"(BN) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  float m[MT][2], l[MT][2];
  float o[MT][NPC][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = NEG_INF;
    l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
    for (int n = 0; n < NPC; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
  }
#if TILE_FP8
  float run_s = 0.f, inv_s = 0.f;   // this warp's largest tile scale so far, its reciprocal (P . C's above)
#elif E8M0
  int run_e = -1000;                // the largest token exponent so far (the accumulator's unit 2^(run_e - 127))
#endif

  // Q's A fragments (entry e = tid + k NT): latent steps kc < 32 (c = kc / 4, o = 4 (kc % 4)) hold columns
  // 64c + 16q + o + (0, 2 | 1, 3) in fp16; k_pe steps hold q_pe (16 (kc - 32) + 2q + (0, 1 | 8, 9)) as stored.
  constexpr int QE = KSTEPS * MT * 32, QN = (QE + NT - 1) / NT;
  u32x2 qv[QN][2];
#pragma unroll
  for (int k = 0; k < QN; ++k) {
    const int e = tid + k * NT;
    const int kc = e / (MT * 32), mt = (e / 32) % MT, ln = e & 31, gg = ln >> 2, qq = ln & 3;
    const int h0 = hb * HB + mt * 16 + gg, h1 = h0 + 8;
    const bool in = QE % NT == 0 || e < QE;
    if (kc < LAT / 16) {
#if ELEM_E4M3
      const int col = 32 * (kc >> 1) + 8 * qq + 4 * (kc & 1);
#else
      const int col = 64 * (kc >> 2) + 16 * qq + 4 * (kc & 3);
#endif
      const u16* r0 = q_lat + b * s_lb + (i64)h0 * s_lh + col;
      const u16* r1 = q_lat + b * s_lb + (i64)h1 * s_lh + col;
      qv[k][0] = in && h0 < num_heads ? *(const u32x2*)r0 : u32x2{0u, 0u};
      qv[k][1] = in && h1 < num_heads ? *(const u32x2*)r1 : u32x2{0u, 0u};
    } else {
      const int col = 16 * (kc - LAT / 16) + 2 * qq;
      const u16* r0 = q_pe + b * s_pb + (i64)h0 * s_ph + col;
      const u16* r1 = q_pe + b * s_pb + (i64)h1 * s_ph + col;
      qv[k][0] = in && h0 < num_heads ? u32x2{*(const u32*)r0, *(const u32*)(r0 + 8)} : u32x2{0u, 0u};
      qv[k][1] = in && h1 < num_heads ? u32x2{*(const u32*)r1, *(const u32*)(r1 + 8)} : u32x2{0u, 0u};
    }
  }
  i64 first[STAGES];
#pragma unroll
  for (int st = 0; st < STAGES; ++st) first[st] = row_slot(st);
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st)
    if (st < n_tiles) load_tile(first[st], st);
  i64 slot_ahead = first[STAGES - 1];
#pragma unroll
  for (int k = 0; k < QN; ++k) {
    const int e = tid + k * NT;
    if (QE % NT == 0 || e < QE) {
      if (e / (MT * 32) < LAT / 16) {
        const u32x2 v0 = qv[k][0], v1 = qv[k][1];
#if ELEM_E4M3  // (x0, x1 | x2, x3) of 4 consecutive values, rounded to fp16
        qs[e] = U4{half2_of(v0.x), half2_of(v1.x), half2_of(v0.y), half2_of(v1.y)};
#else          // (x0, x2 | x1, x3)
        qs[e] = U4{half2_of(prmt(v0.x, v0.y, 0x5410)), half2_of(prmt(v1.x, v1.y, 0x5410)),
                   half2_of(prmt(v0.x, v0.y, 0x7632)), half2_of(prmt(v1.x, v1.y, 0x7632))};
#endif
      } else {
        qs[e] = U4{qv[k][0].x, qv[k][1].x, qv[k][0].y, qv[k][1].y};
      }
    }
  }

#if SCALES == 0
  // byte q of a word, twice (an e4m3x2 pair of the same scale), and bytes g / 2 of two words (two tokens' scales)
  const u32 sel_q = q | (q << 4) | 0x4400u;
  const u32 sel_pair = (g >> 1) | ((4 + (g >> 1)) << 4) | 0x4400u;
#endif

  auto score_tile = [&](const u8* tile, float* out, int* out_ex) {
    // Q . C^T of one tile for this warp's NB n8 blocks of tokens (rows (warp * NB + i) * 8 + g), scaled to base 2,
    // into `out` as [warp][lane][MT][NB] x 4. Four latent accumulators per n8 block (by step or column group;
    // fp8_ds_mla: one a latent tile) and one for k_pe. e8m0: each row's largest block exponent E_r into out_ex, the
    // tile holding code x 2^(e - E_r) and the score taking 2^(E_r - 127).
    float part[MT][NB][5][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < NB; ++i)
#pragma unroll
        for (int k = 0; k < 5; ++k) part[mt][i][k][0] = part[mt][i][k][1] = part[mt][i][k][2] = part[mt][i][k][3] = 0.f;
#if E8M0
    int row_e[NB];   // E_r of this lane's rows: the largest of the row's 16 scale bytes (4 a lane, then the quad)
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      const int r = (warp * NB + i) * 8 + g;
      const u32 w = *(const u32*)(tile + tile_at(r, LAT_BYTES + 4 * q));
      int mx = max(max((int)(w & 255u), (int)((w >> 8) & 255u)), max((int)((w >> 16) & 255u), (int)(w >> 24)));
      mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      row_e[i] = max(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if (q == 0) out_ex[r] = row_e[i];
    }
#endif
#if ELEM_E4M3
    // part[..][t]: latent tile t's dot (k steps 8t .. 8t + 7), the tiles taken in turn so that consecutive MMAs
    // accumulate into different registers
#pragma unroll
    for (int cc = 0; cc < 4; ++cc)
#pragma unroll
      for (int t = 0; t < LAT / 128; ++t) {
        const int c = 4 * t + cc;
        u32 bw[NB][2][2];
#pragma unroll
        for (int i = 0; i < NB; ++i) {
          const int r = (warp * NB + i) * 8 + g;
          const u32x2 w = *(const u32x2*)(tile + tile_at(r, 32 * c + 8 * q));
          bw[i][0][0] = widen2(w.x); bw[i][0][1] = widen2_hi(w.x);
          bw[i][1][0] = widen2(w.y); bw[i][1][1] = widen2_hi(w.y);
#if E8M0   // columns 32c .. 32c + 31: block c's scale, relative to the row's largest (exact for d >= -15)
          const u32 h = pow2_h((int)tile[tile_at(r, LAT_BYTES + c)] - row_e[i]), m2 = h | (h << 16);
          bw[i][0][0] = hmul2(bw[i][0][0], m2); bw[i][0][1] = hmul2(bw[i][0][1], m2);
          bw[i][1][0] = hmul2(bw[i][1][0], m2); bw[i][1][1] = hmul2(bw[i][1][1], m2);
#endif
        }
#pragma unroll
        for (int kk = 0; kk < 2; ++kk)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const U4 a4 = qs[((2 * c + kk) * MT + mt) * 32 + lane];
            const u32 a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
            for (int i = 0; i < NB; ++i) mma16816(part[mt][i][t], a, bw[i][kk][0], bw[i][kk][1]);
          }
      }
#else
#pragma unroll
    for (int c = 0; c < LAT / 64; ++c) {
      u32x2 cw[NB];
      u32 s2[NB];
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        const int r = (warp * NB + i) * 8 + g;
        cw[i] = *(const u32x2*)(tile + tile_at(r, 32 * c + 8 * q));
#if E8M0   // this lane's 16 values lie in block 2c + q / 2 (of 32): its scale relative to the row's largest
        const u32 h = pow2_h((int)tile[tile_at(r, LAT_BYTES + 2 * c + (q >> 1))] - row_e[i]);
        s2[i] = h | (h << 16);
#else
        s2[i] = widen2(prmt(*(const u32*)(tile + tile_at(r, LAT_BYTES + 4 * c)), 0u, sel_q));
#endif
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        u32 bw[NB][2];
#pragma unroll
        for (int i = 0; i < NB; ++i) {
          const u32 w = k < 2 ? cw[i].x : cw[i].y;
          const u32 lo = e4m3_of_low(w), hi = e4m3_of_high(w);
          bw[i][0] = hmul2(k & 1 ? widen2_hi(lo) : widen2(lo), s2[i]);
          bw[i][1] = hmul2(k & 1 ? widen2_hi(hi) : widen2(hi), s2[i]);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const U4 a4 = qs[((4 * c + k) * MT + mt) * 32 + lane];
          const u32 a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
          for (int i = 0; i < NB; ++i) mma16816(part[mt][i][k], a, bw[i][0], bw[i][1]);
        }
      }
    }
#endif
#pragma unroll
    for (int k = 0; k < ROPE / 16; ++k) {
      u32 bw[NB][2];
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        const int r = (warp * NB + i) * 8 + g;
        bw[i][0] = *(const u32*)(tile + tile_at(r, PE_OFF + 32 * k + 4 * q));
        bw[i][1] = *(const u32*)(tile + tile_at(r, PE_OFF + 32 * k + 16 + 4 * q));
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const U4 a4 = qs[((LAT / 16 + k) * MT + mt) * 32 + lane];
        const u32 a[4] = {a4.x, a4.y, a4.z, a4.w};
#pragma unroll
        for (int i = 0; i < NB; ++i) mma_pe(part[mt][i][4], a, bw[i][0], bw[i][1]);
      }
    }
    F4* mine = (F4*)(out + (warp * 32 + lane) * MT * NB * 4);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        float v[4];
#if TILE_FP8   // tokens 2q and 2q + 1 of the n8 block: c0 / c2 and c1 / c3; each tile's dot times its scale
        const int r = (warp * NB + i) * 8 + 2 * q;
        const F4 ts[2] = {*(const F4*)(tile + tile_at(r, LAT_BYTES)), *(const F4*)(tile + tile_at(r + 1, LAT_BYTES))};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const F4 sj = ts[e & 1];
          v[e] = qk_lat * ((sj.x * part[mt][i][0][e] + sj.y * part[mt][i][1][e])
                           + (sj.z * part[mt][i][2][e] + sj.w * part[mt][i][3][e])) + qk_pe * part[mt][i][4][e];
        }
#else
#if E8M0   // tokens 2q and 2q + 1 of the n8 block (rows of lanes 8q and 8q + 4): 2^(E_r - 127)
        const float fe[2] = {e8m0_value(__shfl_sync(0xffffffffu, row_e[i], 8 * q)),
                             e8m0_value(__shfl_sync(0xffffffffu, row_e[i], 8 * q + 4))};
#else
        const float fe[2] = {1.f, 1.f};
#endif
#pragma unroll
        for (int e = 0; e < 4; ++e)
          v[e] = qk_lat * fe[e & 1] * ((part[mt][i][0][e] + part[mt][i][1][e]) + (part[mt][i][2][e] + part[mt][i][3][e]))
                 + qk_pe * part[mt][i][4][e];
#endif
        mine[mt * NB + i] = F4{v[0], v[1], v[2], v[3]};
      }
  };

#if SCALES != 0
  auto rescale = [&](float f) {   // the accumulator into a new unit (fp8_ds_mla's and MX's running largest scale)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NPC; ++n) {
        o[mt][n][0] *= f; o[mt][n][1] *= f; o[mt][n][2] *= f; o[mt][n][3] *= f;
      }
  };
#endif

  // The software pipeline of kernels/mla_decode_fp8.cu: phase t runs the softmax and P . C of tile t and the
  // Q . C^T of tile t + 1 while tiles t + 2 .. t + STAGES - 1 load; one barrier a tile.
  if (n_tiles > 0) {
    wait_parity(smem_addr(bars), 0);
    __syncthreads();   // tile 0 and Q in place
    score_tile(tiles, sx, ex);
  }
  for (int t = 0; t < n_tiles; ++t) {
    if (t + 1 < n_tiles) wait_parity(smem_addr(bars + (t + 1) % STAGES), ((t + 1) / STAGES) & 1);
    __syncthreads();
    if (t + STAGES - 1 < n_tiles) load_tile(slot_ahead, (t + STAGES - 1) % STAGES);
    slot_ahead = row_slot(t + STAGES);
    const u8* tile = tiles + (t % STAGES) * NSTAGE_BYTES;
    const float* scores = sx + (t & 1) * SX_FLOATS;
    // Past the last tile this scores a stale buffer into the unused half of sx: no branch in the phase.
    score_tile(tiles + ((t + 1) % STAGES) * NSTAGE_BYTES, sx + ((t + 1) & 1) * SX_FLOATS, ex + ((t + 1) & 1) * BN);

    const int t0 = start + t * BN;
    const bool partial = t0 + BN > end;
    u32 pa[MT][BN / 16][4];
#if TILE_FP8
    // This warp's latent tile's scales: token `lane`'s (a zeroed row's is 0), the largest so far (run_s, the
    // accumulator's unit; fmaxf passes a NaN by, and a NaN scale's P is NaN), and P's factors scale_j / run_s for the
    // tokens of this lane's fragments (n8 block jb: tokens 8 jb + 2q, + 1)
    const float mine = *(const float*)(tile + tile_at(lane, LAT_BYTES + 4 * warp));
    float tile_max = mine;
#pragma unroll
    for (int d = 16; d; d >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, d));
    if (tile_max > run_s) {   // the same in every lane of the warp
      const float shrink = run_s / tile_max;   // 0 at the first tile (the accumulator is 0 there)
      rescale(shrink);
      run_s = tile_max;
      inv_s = 1.f / tile_max;
    }
    float fac[BN / 8][2];
#pragma unroll
    for (int jb = 0; jb < BN / 8; ++jb) {
      fac[jb][0] = __shfl_sync(0xffffffffu, mine, 8 * jb + 2 * q) * inv_s;
      fac[jb][1] = __shfl_sync(0xffffffffu, mine, 8 * jb + 2 * q + 1) * inv_s;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)   // the scores are scaled already: qk 1
      softmax_tile<NW, NB, MT, NPC, true>(scores, lane, q, mt, 1.f, partial, t0, end, m, l, o, pa, fac);
#elif E8M0
    // The tile's token exponents E_j (row `lane`'s), the largest so far (run_e: the accumulator's unit, an exact
    // power of two, so a rescale is exact), and P's factors 2^(E_j - run_e) <= 1 for this lane's fragments' tokens
    const int* tile_ex = ex + (t & 1) * BN;
    const int mine_e = tile_ex[lane];
    int tile_e = mine_e;
#pragma unroll
    for (int d = 16; d; d >>= 1) tile_e = max(tile_e, __shfl_xor_sync(0xffffffffu, tile_e, d));
    if (tile_e > run_e) {   // the same in every lane of the warp
      const float shrink = pow2f(run_e - tile_e);   // 0 at the first tile (the accumulator is 0 there)
      rescale(shrink);
      run_e = tile_e;
    }
    float fac[BN / 8][2];
#pragma unroll
    for (int jb = 0; jb < BN / 8; ++jb) {
      fac[jb][0] = pow2f(__shfl_sync(0xffffffffu, mine_e, 8 * jb + 2 * q) - run_e);
      fac[jb][1] = pow2f(__shfl_sync(0xffffffffu, mine_e, 8 * jb + 2 * q + 1) - run_e);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)   // the scores are scaled already: qk 1
      softmax_tile<NW, NB, MT, NPC, true>(scores, lane, q, mt, 1.f, partial, t0, end, m, l, o, pa, fac);
#else
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)   // the scores are scaled already: qk 1
      softmax_tile<NW, NB, MT, NPC>(scores, lane, q, mt, 1.f, partial, t0, end, m, l, o, pa);
#endif

    // P . C over this warp's latent columns: n8 block 8m + e holds columns colbase + 64m + 8n + e (n = 0..7). A lane
    // reads 8 columns of tokens r0, r0 + 1, r0 + 8, r0 + 9 (NVFP4: a word, and their block's scale byte).
    const int colbase = warp * (LAT / NW);
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) {
      const int r0 = 16 * j + 2 * q;
#pragma unroll
      for (int mm = 0; mm < NPC / 8; ++mm) {
#if E8M0   // the block of this lane's 8 columns (of 32) in each of the 4 tokens, relative to the token's largest
        const int sb = LAT_BYTES + (colbase + 64 * mm + 8 * g) / 32;
        const int* tile_e = ex + (t & 1) * BN;
        const u32 sab = pow2_h((int)tile[tile_at(r0, sb)] - tile_e[r0]) |
                        pow2_h((int)tile[tile_at(r0 + 1, sb)] - tile_e[r0 + 1]) << 16;
        const u32 scd = pow2_h((int)tile[tile_at(r0 + 8, sb)] - tile_e[r0 + 8]) |
                        pow2_h((int)tile[tile_at(r0 + 9, sb)] - tile_e[r0 + 9]) << 16;
#endif
        // la / ha: e4m3 bytes of the even / odd columns of token a (lb, hb2 of b; lc, hc of c; ld, hd of d)
#if ELEM_E4M3
        const int byte = colbase + 64 * mm + 8 * g;
        const u32x2 wa = *(const u32x2*)(tile + tile_at(r0, byte)), wb = *(const u32x2*)(tile + tile_at(r0 + 1, byte));
        const u32x2 wc = *(const u32x2*)(tile + tile_at(r0 + 8, byte));
        const u32x2 wd = *(const u32x2*)(tile + tile_at(r0 + 9, byte));
        const u32 la = prmt(wa.x, wa.y, 0x6420), lb = prmt(wb.x, wb.y, 0x6420);
        const u32 ha = prmt(wa.x, wa.y, 0x7531), hb2 = prmt(wb.x, wb.y, 0x7531);
        const u32 lc = prmt(wc.x, wc.y, 0x6420), ld = prmt(wd.x, wd.y, 0x6420);
        const u32 hc = prmt(wc.x, wc.y, 0x7531), hd = prmt(wd.x, wd.y, 0x7531);
#else
        const int byte = (colbase + 64 * mm) / 2 + 4 * g;
        const u32 wa = *(const u32*)(tile + tile_at(r0, byte));
        const u32 wb = *(const u32*)(tile + tile_at(r0 + 1, byte));
        const u32 wc = *(const u32*)(tile + tile_at(r0 + 8, byte));
        const u32 wd = *(const u32*)(tile + tile_at(r0 + 9, byte));
        const u32 la = e4m3_of_low(wa), lb = e4m3_of_low(wb), ha = e4m3_of_high(wa), hb2 = e4m3_of_high(wb);
        const u32 lc = e4m3_of_low(wc), ld = e4m3_of_low(wd), hc = e4m3_of_high(wc), hd = e4m3_of_high(wd);
#endif
#if SCALES == 0
        const int sbyte = LAT_BYTES + (colbase + 64 * mm) / 16;
        const u32 sa = *(const u32*)(tile + tile_at(r0, sbyte)), sb = *(const u32*)(tile + tile_at(r0 + 1, sbyte));
        const u32 sc = *(const u32*)(tile + tile_at(r0 + 8, sbyte)), sd = *(const u32*)(tile + tile_at(r0 + 9, sbyte));
        const u32 sab = widen2(prmt(sa, sb, sel_pair)), scd = widen2(prmt(sc, sd, sel_pair));
#endif
        // interleaved by token pair: xe = (a0 b0 a2 b2), ye = (a4 b4 a6 b6) of the even columns, xo / yo the odd ones;
        // ze, ve, zo, vo the same of tokens c, d
        const u32 xe = prmt(la, lb, 0x5140), ye = prmt(la, lb, 0x7362);
        const u32 xo = prmt(ha, hb2, 0x5140), yo = prmt(ha, hb2, 0x7362);
        const u32 ze = prmt(lc, ld, 0x5140), ve = prmt(lc, ld, 0x7362);
        const u32 zo = prmt(hc, hd, 0x5140), vo = prmt(hc, hd, 0x7362);
        // column e of the word: {b0: tokens r0 / r0 + 1, b1: tokens r0 + 8 / r0 + 9}, each pair times its tokens'
        // block scales (fp8_ds_mla: P holds its tile scales)
#if TILE_FP8
        const u32 bx[8][2] = {{widen2(xe), widen2(ze)}, {widen2(xo), widen2(zo)}, {widen2_hi(xe), widen2_hi(ze)},
                              {widen2_hi(xo), widen2_hi(zo)}, {widen2(ye), widen2(ve)}, {widen2(yo), widen2(vo)},
                              {widen2_hi(ye), widen2_hi(ve)}, {widen2_hi(yo), widen2_hi(vo)}};
#else
        const u32 bx[8][2] = {
            {hmul2(widen2(xe), sab), hmul2(widen2(ze), scd)}, {hmul2(widen2(xo), sab), hmul2(widen2(zo), scd)},
            {hmul2(widen2_hi(xe), sab), hmul2(widen2_hi(ze), scd)},
            {hmul2(widen2_hi(xo), sab), hmul2(widen2_hi(zo), scd)},
            {hmul2(widen2(ye), sab), hmul2(widen2(ve), scd)}, {hmul2(widen2(yo), sab), hmul2(widen2(vo), scd)},
            {hmul2(widen2_hi(ye), sab), hmul2(widen2_hi(ve), scd)},
            {hmul2(widen2_hi(yo), sab), hmul2(widen2_hi(vo), scd)}};
#endif
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 8; ++e) mma16816(o[mt][8 * mm + e], pa[mt][j], bx[e][0], bx[e][1]);
      }
    }
  }

  // Partials: out = out_scale * acc / l (0 for an empty split), lse2 = m + log2(l) (-inf for an empty split). A
  // lane's c0 of n8 blocks 8m .. 8m + 7 are columns colbase + 64m + 16q + 0..7 and its c1 the next 8 (c2 / c3: row
  // g + 8): four 16-byte stores a row.
  const int colbase = warp * (LAT / NW);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#if TILE_FP8
    const float unit = out_scale * run_s;   // the accumulator's unit
#elif E8M0
    const float unit = out_scale * e8m0_value(run_e);   // 2^(run_e - 127); no tile: l is 0 below
#else
    const float unit = out_scale;
#endif
    const float f0 = l[mt][0] == 0.f ? 0.f : unit / l[mt][0], f1 = l[mt][1] == 0.f ? 0.f : unit / l[mt][1];
    const int h0 = hb * HB + mt * 16 + g, h1 = h0 + 8;
    float* row0 = part_out + b * s_ob + (i64)h0 * s_oh + (i64)split * s_os + colbase + 16 * q;
    float* row1 = row0 + 8 * (i64)s_oh;
#pragma unroll
    for (int mm = 0; mm < NPC / 8; ++mm) {
#define X(e, c) o[mt][8 * mm + (e)][c]
      if (h0 < num_heads) {
        *(F4*)(row0 + 64 * mm) = F4{X(0, 0) * f0, X(1, 0) * f0, X(2, 0) * f0, X(3, 0) * f0};
        *(F4*)(row0 + 64 * mm + 4) = F4{X(4, 0) * f0, X(5, 0) * f0, X(6, 0) * f0, X(7, 0) * f0};
        *(F4*)(row0 + 64 * mm + 8) = F4{X(0, 1) * f0, X(1, 1) * f0, X(2, 1) * f0, X(3, 1) * f0};
        *(F4*)(row0 + 64 * mm + 12) = F4{X(4, 1) * f0, X(5, 1) * f0, X(6, 1) * f0, X(7, 1) * f0};
      }
      if (h1 < num_heads) {
        *(F4*)(row1 + 64 * mm) = F4{X(0, 2) * f1, X(1, 2) * f1, X(2, 2) * f1, X(3, 2) * f1};
        *(F4*)(row1 + 64 * mm + 4) = F4{X(4, 2) * f1, X(5, 2) * f1, X(6, 2) * f1, X(7, 2) * f1};
        *(F4*)(row1 + 64 * mm + 8) = F4{X(0, 3) * f1, X(1, 3) * f1, X(2, 3) * f1, X(3, 3) * f1};
        *(F4*)(row1 + 64 * mm + 12) = F4{X(4, 3) * f1, X(5, 3) * f1, X(6, 3) * f1, X(7, 3) * f1};
      }
#undef X
    }
    if (warp == 0 && q == 0) {
      const float lse0 = l[mt][0] == 0.f ? NEG_INF : m[mt][0] + log2f(l[mt][0]);
      const float lse1 = l[mt][1] == 0.f ? NEG_INF : m[mt][1] + log2f(l[mt][1]);
      if (h0 < num_heads) part_lse[b * s_eb + (i64)h0 * s_eh + split] = lse0;
      if (h1 < num_heads) part_lse[b * s_eb + (i64)h1 * s_eh + split] = lse1;
    }
  }
}
