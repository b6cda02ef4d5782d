// MLA decode over a paged FP8 latent cache for many heads (64 a block), split-KV, on Hopper's warpgroup MMA
// (wgmma, sm_90a) with warp specialization: the CUDA kernel of kernels/mla_decode.py's impl="cuda", wgmma=True
// (compiled at first use by NVRTC, kernels/nvrtc.py). Defines: STAGES (tiles in flight), PAGE (page size),
// FMT_E5M2, Q_BF16.
//
// Same definition and partial layout as kernels/mla_decode_fp8.cu and the Triton tile kernel: s_j = qk_scale *
// (q_latent . c_j + q_pe . pe_j) (codes widened to fp16 exactly, q rounded to fp16, fp32 accumulation), online
// softmax in base 2, P rounded to fp16 for P . C, out = kv_scale * acc / l, lse2 = m + log2(l) per split;
// kernels/decode_attention.merge_splits combines the splits.
//
// Why this shape: at 128 heads MLA decode is compute-bound (each cache byte feeds 64 multiply-adds a head), so an
// FP8 cache pays off only if the tensor cores run near their wgmma rate. wgmma reads its B operand from shared
// memory, where an fp8 tile would have to be stored widened (K-major for one product, transposed for the other), so
// both products are computed transposed and the cache tile is always the A operand, which wgmma takes from
// registers, widened straight from the fp8 tile as in kernels/mla_decode_fp8.cu:
// - S^T = C . Q^T: M = the tile's 64 tokens (warp w: tokens 16w..16w+15), N = the block's 64 heads, K = 576.
//   A lane holds 4 consecutive codes of one token for each k step; the MMA sums over k in any order, so logical k
//   (2q, 2q+1 | 2q+8, 2q+9) of step s = 4c + k is physical column 64c + 16q + 4k + (0, 1 | 2, 3), and Q sits in
//   shared memory (the B operand, K-major, no swizzle) in that permuted order, written once.
// - O^T = C^T . P^T: M = the latent (m64 tiles), N = the 64 heads, K = the tile's tokens. A lane needs two
//   consecutive tokens of one latent column: 4 codes of each token and one byte permute (prmt) give the code pairs
//   of 4 columns, the rows of 2 m tiles (rows are put back in place at the store). P^T goes to shared memory (the
//   B operand, N-major: a u32 store holds two heads of one token).
// N = 64 (all heads in one wgmma) runs the tensor cores faster than N = 32 (1.5x with one accumulator chain a warp
// group: kernels/BENCHMARKS.md, session 13), and O^T's 64 x 512 fp32 accumulator does not fit one warp group, so
// the block has three warp groups with their own work (warp specialization, as FlashAttention-3 and FlashMLA do):
// group 0 issues the copies (sm_90 bulk copies, one per 576-byte row), computes S^T and the online softmax, and
// publishes P^T and the rescale factors of tile t (double-buffered); groups 1 and 2 each accumulate O^T for half of
// the latent columns (4 m64 tiles, 128 fp32 registers a thread). Group 0's S^T of tile t + 1 runs while groups 1
// and 2 run O^T of tile t.
// Registers are moved between the groups (setmaxnreg): 120 for group 0, 192 for the others (the block holds 3 x 168
// a thread, the launch bounds' allocation: a larger sum would leave an increase waiting forever).
// Hand-offs: named barriers 2 + b ("P^T and alpha of buffer b are ready") and 4 + b ("buffer b is free"), b = t % 2;
// mbarriers per stage: the tile landed (bulk copies' bytes) and every warp is done with it (12 arrivals).

#include "mla_fp8_common.cuh"

#define BN 64                          // tokens per tile
#define HB 64                          // heads per block
#define NT 384                         // three warp groups
#define TPR (128 / BN)                 // threads of group 0 per tile row in the copy
#define Q_BYTES (HB * ROW * 2)         // Q^T as fp16: [k chunk of 8][8-head group][8 heads x 16 bytes]
#define P_BYTES (BN * HB * 2)          // P^T as fp16: [8-token group][8-head chunk][8 tokens x 16 bytes]
#define KSTEPS (ROW / 16)

// The 4 fp8 codes of w as two f16x2 (codes 0, 1 in lo; 2, 3 in hi), exactly. (Bit moves instead of cvt, exact as
// well, ran at 0.75-0.82x the speed: kernels/BENCHMARKS.md, session 13.)
__device__ __forceinline__ void widen4(u32 w, u32& lo, u32& hi) {
  lo = widen2(w);
  hi = widen2_hi(w);
}

// A shared-memory matrix descriptor without swizzle: start address, leading and stride byte offsets (PTX ISA,
// "Matrix Descriptor Format"; K-major: leading = between 8-element k chunks, stride = between 8-row groups;
// N-major: leading = between 8-row k groups, stride = between 8-element n chunks).
__device__ __forceinline__ u64 desc(u32 addr, u32 leading, u32 stride) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((leading & 0x3FFFF) >> 4) << 16)
       | ((u64)((stride & 0x3FFFF) >> 4) << 32);
}

// d (64 x 64 fp32, 32 registers a thread) += A (64 x 16 fp16 in registers) . B (16 x 64 fp16 in shared memory).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_n64(float* d, const u32* a, u64 b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(TRANS_B));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// Accumulators read or written after a wait: the empty asm orders them after it (the compiler sees the wgmma's
// outputs as written at its issue).
__device__ __forceinline__ void fence_regs(float* r, int n) {
#pragma unroll
  for (int i = 0; i < n; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
template <int N>
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, %1;" :: "r"(id), "n"(N) : "memory"); }
template <int N>
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, %1;" :: "r"(id), "n"(N) : "memory"); }
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

extern "C" __global__ void __launch_bounds__(NT, 1) mla_fp8_decode_wgmma(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_pe, const u8* __restrict__ cache,
    const int* __restrict__ block_table, const int* __restrict__ seq_lens, const float* __restrict__ kv_scale,
    float* __restrict__ part_out, float* __restrict__ part_lse, double sm_scale_log2,
    int tokens_per_split, int num_heads,
    int s_lb, int s_lh, int s_pb, int s_ph, int s_cb, int s_cs, int s_tb,
    int s_ob, int s_oh, int s_os, int s_eb, int s_eh) {
  extern __shared__ __align__(128) u8 smem[];
  u8* tiles = smem;                              // STAGES x STAGE_BYTES: the tile rows
  u8* qs = smem + STAGES * STAGE_BYTES;          // Q^T, the B operand of S^T
  u8* ps = qs + Q_BYTES;                         // 2 x P^T, the B operands of O^T
  float* alphas = (float*)(ps + 2 * P_BYTES);    // 2 x [64]: the rescale factors of P^T's tile
  float* red = alphas + 2 * HB;                  // [4 warps][4 q][16]: group 0's column maxima (lane order), then sums
  float* lsum = red + 4 * HB;                    // [64]: l at the end
  u64* full = (u64*)(lsum + HB);                 // one mbarrier per stage: its tile landed
  u64* empty = full + STAGES;                    // one per stage: all 12 warps are done with its tile

  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, q = lane & 3;
  MLA_SPLIT_SPAN;
  const float scale = *kv_scale;
  const float qk = (float)sm_scale_log2 * scale;

  // Tile t of this split into stage st (group 0), one row per TPR threads (one bulk copy a row, the stage's full
  // mbarrier counting BN arrivals and the bytes of the valid rows). Rows past the split's end are zeros (written
  // before the arrival, whose release makes them visible with the tile), so stale or NaN slots never reach the
  // sums. A row's page index is loaded one tile ahead (row_src).
  const int my_row = tid / TPR;
  auto row_src = [&](int t) -> const u8* {
    const int tok = start + t * BN + my_row;
    if (wg != 0 || t >= n_tiles || tok >= end) return nullptr;
    return cache_row(cache, block_table, b, s_tb, s_cb, s_cs, tok);
  };
  auto load_tile = [&](const u8* src, int st) {
    u8* stage = tiles + st * STAGE_BYTES;
    if (tid % TPR == 0) {
      const u32 bar = smem_addr(full + st);
      if (!src)
        for (int ch = 0; ch < ROW / 16; ++ch) *(U4*)(stage + at(my_row, 16 * ch)) = U4{0u, 0u, 0u, 0u};
      bulk_row(bar, smem_addr(stage + at(my_row, 0)), src);
    }
  };
  if (tid == 0) {
    for (int st = 0; st < STAGES; ++st) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(full + st)), "r"(BN) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(empty + st)), "r"(NT / 32) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const u8* src_ahead = nullptr;
  if (wg == 0) {
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st)
      if (st < n_tiles) load_tile(row_src(st), st);
    src_ahead = row_src(STAGES - 1);
  }

  // Q^T (K-major B operand, no swizzle): element (head h, logical k 16s + kk) at k chunk 2s + kk / 8, 8-head group
  // h / 8, byte (h % 8) x 16 + (kk % 8) x 2; logical kk = 2q, 2q + 1, 2q + 8, 2q + 9 hold physical columns
  // 64c + 16q + 4k + 0..3 (s = 4c + k), 4 consecutive query elements read at once.
  for (int e = tid; e < HB * KSTEPS * 4; e += NT) {
    const int h = e / (KSTEPS * 4), s = (e >> 2) % KSTEPS, qq = e & 3, c = s >> 2, k = s & 3;
    const int head = hb * HB + h;
    const u16* src = c < LAT / 64 ? q_lat + b * s_lb + (i64)head * s_lh + 64 * c + 16 * qq + 4 * k
                                  : q_pe + b * s_pb + (i64)head * s_ph + 16 * qq + 4 * k;
    const u32x2 v = head < num_heads ? *(const u32x2*)src : u32x2{0u, 0u};
    u8* dst = qs + (2 * s) * (HB * 16) + (h >> 3) * 128 + (h & 7) * 16 + 4 * qq;
    *(u32*)dst = half2_of(v.x);
    *(u32*)(dst + HB * 16) = half2_of(v.y);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // Q's generic stores, read by wgmma
  __syncthreads();

  float m[16], lp[16];   // group 0: per head 8j + 2q + e (index 2j + e): running max, this thread's share of l
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 120;");
#pragma unroll
    for (int i = 0; i < 16; ++i) { m[i] = NEG_INF; lp[i] = 0.f; }
    // built once: k step s is s x 2048 bytes further, + 128 in the descriptor's address field (addr >> 4, 14 bits;
    // shared memory ends below 2^18 bytes, so the sum never carries out of the field)
    const u64 q_desc0 = desc(smem_addr(qs), HB * 16, 128);
    const int r_lo = 16 * warp + g;
    for (int t = 0; t < n_tiles; ++t) {
      const int buf = t & 1;
      wait_parity(smem_addr(full + t % STAGES), (t / STAGES) & 1);
      const u8* tile = tiles + (t % STAGES) * STAGE_BYTES;
      // S^T, 4 k steps (16 codes a lane of each of its two tokens) per commit group.
      float sc[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) sc[i] = 0.f;
#pragma unroll
      for (int c = 0; c < ROW / 64; ++c) {
        const U4 w0 = *(const U4*)(tile + at(r_lo, 64 * c + 16 * q));
        const U4 w1 = *(const U4*)(tile + at(r_lo + 8, 64 * c + 16 * q));
        u32 a[4][4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const u32 x0 = k == 0 ? w0.x : k == 1 ? w0.y : k == 2 ? w0.z : w0.w;
          const u32 x1 = k == 0 ? w1.x : k == 1 ? w1.y : k == 2 ? w1.z : w1.w;
          widen4(x0, a[k][0], a[k][2]);
          widen4(x1, a[k][1], a[k][3]);
        }
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) wgmma_n64<0>(sc, a[k], q_desc0 + (u64)((4 * c + k) * 2 * HB));
        wgmma_commit();
        wgmma_wait<1>();   // group c - 1 is done: its A registers take group c + 1
      }
      wgmma_wait<0>();
      fence_regs(sc, 32);
      if (lane == 0) mbar_arrive(smem_addr(empty + t % STAGES));   // this warp is done reading tile t

      // Online softmax over the tile's tokens (the rows), per head (the columns): column maxima within the warp
      // (rows g, g + 8, then lanes), across the group's 4 warps through shared memory.
      const int t0 = start + t * BN;
      const bool out0 = t0 + r_lo >= end, out1 = t0 + r_lo + 8 >= end;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          sc[4 * j + e] = out0 ? NEG_INF : sc[4 * j + e] * qk;
          sc[4 * j + 2 + e] = out1 ? NEG_INF : sc[4 * j + 2 + e] * qk;
          float v = fmaxf(sc[4 * j + e], sc[4 * j + 2 + e]);
          v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
          v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
          v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
          if (g == 0) red[warp * HB + 16 * q + 2 * j + e] = v;   // column 8j + 2q + e at lane q's slot 2j + e
        }
      bar_sync<128>(1);
      if (t >= 2) bar_sync<NT>(4 + buf);   // groups 1 and 2 are done with buffer buf (tile t - 2)
      u8* pt = ps + buf * P_BYTES;
      float tmaxs[16];   // the tile's maxima of this lane's 16 columns: 4 float4 reads a warp's row, 4 warps
#pragma unroll
      for (int i4 = 0; i4 < 4; ++i4) {
        const float* col = red + 16 * q + 4 * i4;
        const float4 r0 = *(const float4*)col, r1 = *(const float4*)(col + HB);
        const float4 r2 = *(const float4*)(col + 2 * HB), r3 = *(const float4*)(col + 3 * HB);
        tmaxs[4 * i4] = fmaxf(fmaxf(r0.x, r1.x), fmaxf(r2.x, r3.x));
        tmaxs[4 * i4 + 1] = fmaxf(fmaxf(r0.y, r1.y), fmaxf(r2.y, r3.y));
        tmaxs[4 * i4 + 2] = fmaxf(fmaxf(r0.z, r1.z), fmaxf(r2.z, r3.z));
        tmaxs[4 * i4 + 3] = fmaxf(fmaxf(r0.w, r1.w), fmaxf(r2.w, r3.w));
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * j + 2 * q + e, i = 2 * j + e;
          const float tmax = tmaxs[i];
          const float mn = fmaxf(m[i], tmax);
          const float alpha = ex2(m[i] - mn);
          m[i] = mn;
          p[e] = ex2(sc[4 * j + e] - mn);
          p[2 + e] = ex2(sc[4 * j + 2 + e] - mn);
          lp[i] = lp[i] * alpha + (p[e] + p[2 + e]);
          if (warp == 0 && g == 0) alphas[buf * HB + col] = alpha;
        }
        // P^T (N-major B operand, no swizzle): token r, head n at 8-token group r / 8 (1024 bytes apart), 8-head
        // chunk n / 8 (128 bytes apart), byte (r % 8) x 16 + (n % 8) x 2: a warp's store is one core matrix.
        *(u32*)(pt + (2 * warp) * 1024 + j * 128 + g * 16 + 4 * q) = pack_half2(p[0], p[1]);
        *(u32*)(pt + (2 * warp + 1) * 1024 + j * 128 + g * 16 + 4 * q) = pack_half2(p[2], p[3]);
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // P^T's generic stores, read by wgmma
      bar_sync<128>(1);    // the maxima are read (red is rewritten next tile) ...
      bar_arrive<NT>(2 + buf);   // ... and P^T, alpha of tile t are out
      // The stage of tile t - 1 takes tile t + STAGES - 1 once every warp is done with t - 1.
      if (t + STAGES - 1 < n_tiles) {
        if (t >= 1) wait_parity(smem_addr(empty + (t - 1) % STAGES), ((t - 1) / STAGES) & 1);
        load_tile(src_ahead, (t + STAGES - 1) % STAGES);
      }
      src_ahead = row_src(t + STAGES);
    }
    for (int t = max(n_tiles - 2, 0); t < n_tiles; ++t) bar_sync<NT>(4 + (t & 1));   // the last hand-backs
    // l: this thread's shares summed over the lanes of a column (g) and the group's 4 warps.
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      lp[i] += __shfl_xor_sync(0xffffffffu, lp[i], 4);
      lp[i] += __shfl_xor_sync(0xffffffffu, lp[i], 8);
      lp[i] += __shfl_xor_sync(0xffffffffu, lp[i], 16);
    }
    if (g == 0)
#pragma unroll
      for (int i = 0; i < 16; ++i) red[warp * HB + 8 * (i >> 1) + 2 * q + (i & 1)] = lp[i];
    bar_sync<128>(1);
    if (warp == 0 && g == 0)
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int col = 8 * (i >> 1) + 2 * q + (i & 1), head = hb * HB + col;
        const float l = (red[col] + red[HB + col]) + (red[2 * HB + col] + red[3 * HB + col]);
        lsum[col] = l;
        if (head < num_heads) part_lse[b * s_eb + (i64)head * s_eh + split] = l == 0.f ? NEG_INF : m[i] + log2f(l);
      }
    __syncthreads();   // l is out; groups 1 and 2 stage the output
    __syncthreads();   // the output is staged
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 192;");
    const int half = wg - 1;   // latent columns 256 half .. 256 half + 255: m tiles 0..3
    float o[4][32];   // O^T: m tile mt, rows 16 warp + g (+ 8), heads 8j + 2q + e
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int i = 0; i < 32; ++i) o[mt][i] = 0.f;
    for (int t = 0; t < n_tiles; ++t) {
      const int buf = t & 1;
      wait_parity(smem_addr(full + t % STAGES), (t / STAGES) & 1);
      bar_sync<NT>(2 + buf);   // P^T and alpha of tile t
      const u8* tile = tiles + (t % STAGES) * STAGE_BYTES;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float alpha = alphas[buf * HB + 8 * j + 2 * q + e];
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            o[mt][4 * j + e] *= alpha;
            o[mt][4 * j + 2 + e] *= alpha;
          }
        }
      // O^T += C^T . P^T, one commit group per 16-token k step (two in flight). Load group mm of warp w covers
      // latent bytes 256 half + 64w + 32mm + 4g + 0..3: columns + 0, + 1 are rows g, g + 8 of m tile 2mm, columns
      // + 2, + 3 those of 2mm + 1.
      const u64 p_desc0 = desc(smem_addr(ps + buf * P_BYTES), 1024, 128);   // k step s: + 128 (2048 bytes)
#pragma unroll
      for (int s = 0; s < BN / 16; ++s) {
        const int r0 = 16 * s + 2 * q;
        u32 a[4][4];
#pragma unroll
        for (int mm = 0; mm < 2; ++mm) {
          const int byte = 256 * half + 64 * warp + 32 * mm + 4 * g;
          const u32 wa = *(const u32*)(tile + at(r0, byte));
          const u32 wb = *(const u32*)(tile + at(r0 + 1, byte));
          const u32 wc = *(const u32*)(tile + at(r0 + 8, byte));
          const u32 wd = *(const u32*)(tile + at(r0 + 9, byte));
          const u32 x = prmt(wa, wb, 0x5140), y = prmt(wa, wb, 0x7362);   // (a0 b0 a1 b1), (a2 b2 a3 b3)
          const u32 z = prmt(wc, wd, 0x5140), v = prmt(wc, wd, 0x7362);
          widen4(x, a[2 * mm][0], a[2 * mm][1]);
          widen4(z, a[2 * mm][2], a[2 * mm][3]);
          widen4(y, a[2 * mm + 1][0], a[2 * mm + 1][1]);
          widen4(v, a[2 * mm + 1][2], a[2 * mm + 1][3]);
        }
        wgmma_fence();
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) wgmma_n64<1>(o[mt], a[mt], p_desc0 + (u64)(s * 128));
        wgmma_commit();
        wgmma_wait<1>();
      }
      wgmma_wait<0>();
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) fence_regs(o[mt], 32);
      if (lane == 0) mbar_arrive(smem_addr(empty + t % STAGES));   // this warp is done reading tile t
      bar_arrive<NT>(4 + buf);   // buffer buf is free
    }
    __syncthreads();   // l is out (and every group is done with the tiles and Q)
    // Partials: out = kv_scale * acc / l (0 for an empty split), staged as [64 heads][513 floats] over the tiles
    // and Q, then coalesced stores.
    float* stage = (float*)smem;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int h = 8 * j + 2 * q + e;
        const float l = lsum[h];
        const float f = l == 0.f ? 0.f : scale / l;
        float* row = stage + h * (LAT + 1);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          const int lat = 256 * half + 64 * warp + 32 * (mt >> 1) + 4 * g + 2 * (mt & 1);
          row[lat] = o[mt][4 * j + e] * f;
          row[lat + 1] = o[mt][4 * j + 2 + e] * f;
        }
      }
    __syncthreads();
  }
  const float* stage = (const float*)smem;
  for (int e = tid; e < HB * LAT; e += NT) {
    const int row = e / LAT, col = e % LAT, head = hb * HB + row;
    if (head < num_heads)
      part_out[b * s_ob + (i64)head * s_oh + (i64)split * s_os + col] = stage[row * (LAT + 1) + col];
  }
}
