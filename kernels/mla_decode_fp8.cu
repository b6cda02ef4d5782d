// MLA decode over a paged FP8 latent cache (16 x MT heads per block), split-KV: the CUDA kernel of
// kernels/mla_decode.py's impl="cuda" (compiled at first use by NVRTC, kernels/nvrtc.py; sm_89 and later, bulk
// copies from sm_90). Defines: NW warps, NB n8 token blocks a warp, STAGES tiles in flight, MT m16 head tiles,
// CTAS blocks per SM (launch bounds), PAGE page size, BULK, TILE_BYTES, FMT_E5M2, Q_BF16 (kernels/mla_decode.py).
//
// Same definition and partial layout as the Triton tile kernel: s_j = qk_scale * (q_latent . c_j + q_pe . pe_j)
// (codes widened to fp16 exactly, q rounded to fp16, fp32 accumulation), online softmax in base 2, P rounded
// to fp16 for P . C, out = kv_scale * acc / l, lse2 = m + log2(l) per split; kernels/decode_attention.merge_splits
// combines the splits, or this file's mla_fp8_merge (the cuda_merge launch). Cache rows are [latent 512 | rope 64]
// codes, one scale per cache.
//
// Why a hand-written kernel: Q . C^T contracts the latent (contiguous in a cache row), P . C contracts the tokens
// (strided), and an fp8 operand must be K-contiguous, so a compiler that widens in the MMA operand layouts
// gathers the P . C operand a byte at a time, or widens the tile through shared memory once more
// (kernels/BENCHMARKS.md, sessions 7-9). Here both products use mma.sync.m16n8k16 (f16 in, f32 accumulate) and
// every fp8 operand is widened in registers straight from the shared-memory tile, in an order that each product's
// fragment layout can use without moving data between lanes:
// - Q . C^T: a lane holds 4 consecutive codes of one token for each 16-wide k step. The MMA sums over k in any
//   order, so logical k (2q, 2q+1 | 2q+8, 2q+9) is mapped to physical columns (4q, 4q+1 | 4q+2, 4q+3) of the
//   step, and Q is stored in shared memory in the same permuted A-fragment order (one 16-byte load a step).
// - P . C: a lane needs two consecutive tokens of one latent column (the k pair). It loads 4 consecutive codes
//   of each token and interleaves the two words with one byte permute (prmt), which yields the code pairs of 4
//   latent columns; the 4 columns become 4 different n8 blocks (the output columns are permuted and put back
//   in place at the store).
// Warps split the tile's tokens for Q . C^T (full 576-wide dot products, no partial sums) and the latent
// columns for P . C (LAT / NW each); the score tile crosses warps once through shared memory (one barrier a
// tile, software-pipelined), and every warp runs the (cheap) online softmax over the whole tile, so m and l agree
// bit for bit. Tile rows are placed (at()) so that both read patterns are bank-conflict free.

#include "mla_fp8_common.cuh"

#define NT (NW * 32)
#define BN (NW * NB * 8)               // tokens per tile
#define NPC (LAT / (8 * NW))           // n8 latent blocks per warp in P . C
#define HB (16 * MT)                   // heads per block: MT m16 tiles, each B fragment feeds MT MMAs
#define TPR (NT >= BN ? NT / BN : 1)   // threads per tile row in the copy
#define SX_FLOATS (NW * 32 * MT * NB * 4)   // one tile's scores

// Loads of what the split kernel wrote (ld.global.cg: from L2); volatile, so they stay in the order written (the
// merge issues a chunk of them before it uses any).
__device__ __forceinline__ float load_l2(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ F2 load2_l2(const float* p) {
  F2 v;
  asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ u32 pack_out(float lo, float hi) {   // two outputs in the query's dtype (RTNE)
#if Q_BF16
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return pack_half2(lo, hi);
#endif
}

// The splits merged as kernels/decode_attention.merge_splits does (its formula; its Triton kernel sums the weights as
// a tree, divides by div.full and takes lg2.approx, so the last bits may differ): for head h of sequence b, m = the
// largest base-2 split lse (0 when every split is empty), w_s = 2^(lse_s - m), out = sum_s w_s out_s / sum_s w_s
// (summed in split order; 0 when the weights sum to 0; NaN stays NaN) in the query's dtype, and
// lse = (m + log2 sum_s w_s) ln 2. A block per (head, sequence), 2 columns a thread; (splits + 1) floats of dynamic
// shared memory. Launched as a programmatic dependent launch (sm_90), its blocks become resident while the split
// kernel runs and wait in griddepcontrol.wait until it has finished and its stores are visible: no launch gap. The
// partials are written while this grid is alive, so they are read from L2, not through the read-only path. Each
// thread has MERGE_CHUNK splits' loads in flight at once, the first chunk's issued before the weights are computed:
// at 32 splits or fewer the partials and the lse values cost one round trip to L2. A split's partial row is LAT floats
// after the last (partials() makes them contiguous), so the chunk's addresses are one register and immediate offsets.
#define MERGE_CHUNK 32
extern "C" __global__ void __maxnreg__(96) mla_fp8_merge(   // 96: beside two split blocks (152 each) on an SM
    const float* part_out, const float* part_lse, u16* __restrict__ out,
    float* __restrict__ lse, int splits, int s_ob, int s_oh, int s_eb, int s_eh, int s_Ob, int s_Oh) {
  extern __shared__ float w[];
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int h = blockIdx.x, tid = threadIdx.x;
  const i64 b = blockIdx.y;
  const float* src = part_out + b * s_ob + (i64)h * s_oh + 2 * tid;
  F2 v[MERGE_CHUNK];
#pragma unroll
  for (int i = 0; i < MERGE_CHUNK; ++i)
    if (i < splits) v[i] = load2_l2(src + i * LAT);
  if (tid < 32) {   // the weights and their sum, by one warp
    const float* row = part_lse + b * s_eb + (i64)h * s_eh;
    float mx = NEG_INF;
    for (int s = tid; s < splits; s += 32) {
      w[s] = load_l2(row + s);
      mx = fmaxf(mx, w[s]);
    }
#pragma unroll
    for (int k = 16; k; k >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, k));
    if (mx == NEG_INF) mx = 0.f;
    float sum = 0.f;
    for (int s = tid; s < splits; s += 32) {
      w[s] = ex2(w[s] - mx);
      sum += w[s];
    }
#pragma unroll
    for (int k = 16; k; k >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, k);
    if (tid == 0) {
      w[splits] = sum;
      lse[b * gridDim.x + h] = (mx + log2f(sum)) * 0.6931471805599453f;
    }
  }
  __syncthreads();
  float a0 = 0.f, a1 = 0.f;
  for (int s = 0; s < splits; s += MERGE_CHUNK) {   // the sums in split order
    if (s > 0) {
#pragma unroll
      for (int i = 0; i < MERGE_CHUNK; ++i)
        if (s + i < splits) v[i] = load2_l2(src + (i64)(s + i) * LAT);
    }
#pragma unroll
    for (int i = 0; i < MERGE_CHUNK; ++i)
      if (s + i < splits) {
        a0 = fmaf(w[s + i], v[i].x, a0);
        a1 = fmaf(w[s + i], v[i].y, a1);
      }
  }
  const float d = w[splits];
  if (d == 0.f) a0 = a1 = 0.f;
  else { a0 /= d; a1 /= d; }
  *(u32*)(out + b * s_Ob + (i64)h * s_Oh + 2 * tid) = pack_out(a0, a1);
}

extern "C" __global__ void __launch_bounds__(NT, CTAS) mla_fp8_decode(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_pe, const u8* __restrict__ cache,
    const int* __restrict__ block_table, const int* __restrict__ seq_lens, const float* __restrict__ kv_scale,
    float* __restrict__ part_out, float* __restrict__ part_lse, double sm_scale_log2,
    int tokens_per_split, int num_heads,
    int s_lb, int s_lh, int s_pb, int s_ph, int s_cb, int s_cs, int s_tb,
    int s_ob, int s_oh, int s_os, int s_eb, int s_eh) {
  extern __shared__ __align__(128) u8 smem[];
  u8* tiles = smem;                              // STAGES x STAGE_BYTES (TILE_BYTES in all): the tile rows
  U4* qs = (U4*)(smem + TILE_BYTES);             // [36 k steps][MT][32 lanes] A fragments
  float* sx = (float*)(qs + (ROW / 16) * MT * 32);   // 2 x [NW][32 lanes][MT][NB] x 4 scores
  unsigned long long* bars = (unsigned long long*)(sx + 2 * SX_FLOATS);   // BULK: one mbarrier per stage

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  MLA_SPLIT_SPAN;
  const float scale = *kv_scale;
  const float qk = (float)sm_scale_log2 * scale;
#if __CUDA_ARCH__ >= 900
  // A programmatic dependent launch after this one (mla_fp8_merge) may start now: its blocks take only what this
  // grid's blocks leave of an SM, and wait for this grid to finish.
  asm volatile("griddepcontrol.launch_dependents;");
#endif

  // Tile t of this split into stage buffer st, one tile row per thread group of TPR threads. Rows past the
  // split's end are zeros (cp.async's src-size 0, or stores), so stale or NaN slots never reach the sums (P is 0
  // there, and 0 x NaN would not be). A row's address needs its page index, which is loaded one tile ahead
  // (row_src), so the copies never wait for the block table.
  const int my_row = tid / TPR;
  auto row_src = [&](int t) -> const u8* {
    const int tok = start + t * BN + my_row;
    if (t >= n_tiles || tok >= end) return nullptr;
    return cache_row(cache, block_table, b, s_tb, s_cb, s_cs, tok);
  };
  auto load_tile = [&](const u8* src, int st) {
    u8* stage = tiles + st * STAGE_BYTES;
#if BULK
    if (tid % TPR == 0) {   // the stage's mbarrier counts BN arrivals and the bytes of the valid rows
      bulk_row(smem_addr(bars + st), smem_addr(stage + at(my_row, 0)), src);
    }
    if (!src)
      for (int ch = tid % TPR; ch < ROW / 16; ch += TPR) *(U4*)(stage + at(my_row, 16 * ch)) = U4{0u, 0u, 0u, 0u};
#else
    const int n = src ? 16 : 0;
    if (!src) src = cache;
#pragma unroll
    for (int ch = tid % TPR; ch < ROW / 16; ch += TPR)
      asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;"
                   :: "r"(smem_addr(stage + at(my_row, 16 * ch))), "l"(src + ch * 16), "r"(n));
#endif
  };
  // Tile t has landed, for this thread (the phase barrier then makes it visible to all). cp.async: wait_group.
  auto wait_tile = [&](int t) {
#if BULK
    wait_parity(smem_addr(bars + t % STAGES), (t / STAGES) & 1);
#else
    (void)t;
#endif
  };
#if BULK
  if (tid == 0) {
    for (int st = 0; st < STAGES; ++st)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bars + st)), "r"(BN) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
#endif

  float m[MT][2], l[MT][2];   // rows g and g + 8 of each m tile
  float o[MT][NPC][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = NEG_INF;
    l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
    for (int n = 0; n < NPC; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
  }

  // The prologue's global loads go out together: this thread's Q elements (into registers), then the page indices of
  // the first STAGES tiles, before the first copy (an asm volatile with a memory clobber, which no load moves
  // across); Q's conversion and shared-memory stores follow the copies. Issued one copy or one loop iteration at a
  // time they were a chain of dependent memory round trips before the first tile's MMAs (batch 8, 8k: ~8% of the
  // kernel's time).
  constexpr int QE = (ROW / 16) * MT * 32, QN = (QE + NT - 1) / NT;   // A-fragment entries e = tid + k NT
  u32x2 qv[QN][2];
#pragma unroll
  for (int k = 0; k < QN; ++k) {
    const int e = tid + k * NT;
    const int kc = e / (MT * 32), mt = (e / 32) % MT, ln = e & 31, gg = ln >> 2, qq = ln & 3, c = kc >> 2, i = kc & 3;
    const int h0 = hb * HB + mt * 16 + gg, h1 = h0 + 8;
    const u16 *r0, *r1;
    if (c < LAT / 64) {
      const int col = 64 * c + 16 * qq + 4 * i;
      r0 = q_lat + b * s_lb + (i64)h0 * s_lh + col;
      r1 = q_lat + b * s_lb + (i64)h1 * s_lh + col;
    } else {
      const int col = 16 * qq + 4 * i;
      r0 = q_pe + b * s_pb + (i64)h0 * s_ph + col;
      r1 = q_pe + b * s_pb + (i64)h1 * s_ph + col;
    }
    const bool in = QE % NT == 0 || e < QE;
    qv[k][0] = in && h0 < num_heads ? *(const u32x2*)r0 : u32x2{0u, 0u};
    qv[k][1] = in && h1 < num_heads ? *(const u32x2*)r1 : u32x2{0u, 0u};
  }
  const u8* first[STAGES];
#pragma unroll
  for (int st = 0; st < STAGES; ++st) first[st] = row_src(st);
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_tiles) load_tile(first[st], st);
    asm volatile("cp.async.commit_group;");
  }
  const u8* src_ahead = first[STAGES - 1];
  // Q as fp16 A fragments in the permuted k order (see the top of the file), while the first tiles load.
#pragma unroll
  for (int k = 0; k < QN; ++k) {
    const int e = tid + k * NT;
    if (QE % NT == 0 || e < QE)
      qs[e] = U4{half2_of(qv[k][0].x), half2_of(qv[k][1].x), half2_of(qv[k][0].y), half2_of(qv[k][1].y)};
  }

  auto score_tile = [&](const u8* tile, float* out) {
    // Q . C^T of one tile for this warp's NB n8 blocks of tokens (rows (warp * NB + i) * 8 + g), into the score
    // buffer `out` as [warp][lane][MT][NB] x 4.
    // Four accumulators per n8 block (k step 4c + k goes to accumulator k): chains of 9 dependent MMAs, not 36.
    float part[MT][NB][4][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < NB; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) part[mt][i][k][0] = part[mt][i][k][1] = part[mt][i][k][2] = part[mt][i][k][3] = 0.f;
#pragma unroll
    for (int c = 0; c < ROW / 64; ++c) {
      U4 cw[NB];
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        const int r = (warp * NB + i) * 8 + g;
        cw[i] = *(const U4*)(tile + at(r, 16 * (4 * c + q)));
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        u32 bw[NB][2];
#pragma unroll
        for (int i = 0; i < NB; ++i) {
          const u32 w = k == 0 ? cw[i].x : k == 1 ? cw[i].y : k == 2 ? cw[i].z : cw[i].w;
          bw[i][0] = widen2(w);
          bw[i][1] = widen2_hi(w);
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
    F4* mine = (F4*)(out + (warp * 32 + lane) * MT * NB * 4);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
          v[e] = (part[mt][i][0][e] + part[mt][i][1][e]) + (part[mt][i][2][e] + part[mt][i][3][e]);
        mine[mt * NB + i] = F4{v[0], v[1], v[2], v[3]};
      }
  };

  // Software pipeline, one barrier a tile: phase t runs the softmax and P . C of tile t and the Q . C^T of tile
  // t + 1 (independent MMAs the scheduler interleaves), while tiles t + 2 .. t + STAGES - 1 load. The scores cross
  // warps through a double buffer; a phase's barrier makes tile t + 1 and the scores of tile t visible and frees
  // the buffer of tile t - 1 for the next copy.
  if (n_tiles > 0) {
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2));
    wait_tile(0);
    __syncthreads();   // tile 0 and Q in place
    score_tile(tiles, sx);
  }
  for (int t = 0; t < n_tiles; ++t) {
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 3));   // this thread's copies of tile t + 1
    if (t + 1 < n_tiles) wait_tile(t + 1);
    __syncthreads();
    if (t + STAGES - 1 < n_tiles) load_tile(src_ahead, (t + STAGES - 1) % STAGES);
    asm volatile("cp.async.commit_group;");
    src_ahead = row_src(t + STAGES);
    const u8* tile = tiles + (t % STAGES) * STAGE_BYTES;
    const float* scores = sx + (t & 1) * SX_FLOATS;
    // Past the last tile this scores a stale buffer into the unused half of sx: no branch in the phase.
    score_tile(tiles + ((t + 1) % STAGES) * STAGE_BYTES, sx + ((t + 1) & 1) * SX_FLOATS);

    // The whole tile's scores (n8 block j = warp' * NB + i), scaled and masked; online softmax; P as A fragments
    // of P . C (the accumulator layout of n8 blocks 2j and 2j + 1 is the A layout of k step j).
    const int t0 = start + t * BN;
    const bool partial = t0 + BN > end;
    u32 pa[MT][BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) softmax_tile<NW, NB, MT, NPC>(scores, lane, q, mt, qk, partial, t0, end, m, l, o, pa);

    // P . C over this warp's latent columns: n8 block 4m + i holds columns colbase + 32m + 4n + i (n = 0..7).
    const int colbase = warp * (LAT / NW);
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) {
      const int r0 = 16 * j + 2 * q;
#pragma unroll
      for (int mm = 0; mm < NPC / 4; ++mm) {
        const int byte = colbase + 32 * mm + 4 * g;
        const u32 wa = *(const u32*)(tile + at(r0, byte));
        const u32 wb = *(const u32*)(tile + at(r0 + 1, byte));
        const u32 wc = *(const u32*)(tile + at(r0 + 8, byte));
        const u32 wd = *(const u32*)(tile + at(r0 + 9, byte));
        const u32 x = prmt(wa, wb, 0x5140), y = prmt(wa, wb, 0x7362);   // (a0 b0 a1 b1), (a2 b2 a3 b3)
        const u32 z = prmt(wc, wd, 0x5140), v = prmt(wc, wd, 0x7362);
        const u32 bx[4][2] = {{widen2(x), widen2(z)}, {widen2_hi(x), widen2_hi(z)},
                              {widen2(y), widen2(v)}, {widen2_hi(y), widen2_hi(v)}};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int i = 0; i < 4; ++i) mma16816(o[mt][4 * mm + i], pa[mt][j], bx[i][0], bx[i][1]);
      }
    }
  }

  // Partials: out = kv_scale * acc / l (0 for an empty split), lse2 = m + log2(l) (-inf for an empty split), stored
  // from the accumulators: n8 blocks 4m .. 4m + 3 of a lane hold 4 consecutive columns (colbase + 32m + 8q + i) in
  // c0 / c2 and the next 4 in c1 / c3, one 16-byte store each. (Staged through shared memory for coalesced 4-byte
  // stores they cost 12 times the instructions at the end of every block: batch 8, 32k, ~2% of the kernel.)
  const int colbase = warp * (LAT / NW);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const float f0 = l[mt][0] == 0.f ? 0.f : scale / l[mt][0], f1 = l[mt][1] == 0.f ? 0.f : scale / l[mt][1];
    const int h0 = hb * HB + mt * 16 + g, h1 = h0 + 8;
    float* row0 = part_out + b * s_ob + (i64)h0 * s_oh + (i64)split * s_os + colbase + 8 * q;
    float* row1 = row0 + 8 * (i64)s_oh;
#pragma unroll
    for (int mm = 0; mm < NPC / 4; ++mm) {
      const int n = 4 * mm;
      if (h0 < num_heads) {
        *(F4*)(row0 + 32 * mm) =
            F4{o[mt][n][0] * f0, o[mt][n + 1][0] * f0, o[mt][n + 2][0] * f0, o[mt][n + 3][0] * f0};
        *(F4*)(row0 + 32 * mm + 4) =
            F4{o[mt][n][1] * f0, o[mt][n + 1][1] * f0, o[mt][n + 2][1] * f0, o[mt][n + 3][1] * f0};
      }
      if (h1 < num_heads) {
        *(F4*)(row1 + 32 * mm) =
            F4{o[mt][n][2] * f1, o[mt][n + 1][2] * f1, o[mt][n + 2][2] * f1, o[mt][n + 3][2] * f1};
        *(F4*)(row1 + 32 * mm + 4) =
            F4{o[mt][n][3] * f1, o[mt][n + 1][3] * f1, o[mt][n + 2][3] * f1, o[mt][n + 3][3] * f1};
      }
    }
    if (warp == 0 && q == 0) {
      const float lse0 = l[mt][0] == 0.f ? NEG_INF : m[mt][0] + log2f(l[mt][0]);
      const float lse1 = l[mt][1] == 0.f ? NEG_INF : m[mt][1] + log2f(l[mt][1]);
      if (h0 < num_heads) part_lse[b * s_eb + (i64)h0 * s_eh + split] = lse0;
      if (h1 < num_heads) part_lse[b * s_eb + (i64)h1 * s_eh + split] = lse1;
    }
  }
}
