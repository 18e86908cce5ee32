// lora_one: the delta of a step of one position (the capture bucket of 1: a decode step of one
// sequence), every slice of the target, in one launch of thread-block clusters, with no workspace,
// no counters and no round trip through global memory between blocks. Included by lora_mma.cu
// (it uses Args from there).
//
// Why: at one position the delta moves little (A and B of one slot: 0.3-1.2 MB for the Llama-8B
// layer's targets at rank 16) and its time is the chain of dependent rounds a call runs through.
// lora_fused splits `in` over blocks that add into v in L2 and count themselves ready, and expand
// blocks poll the count, then read v: 8.3-10.1 us a call in a warm layer (NOTES.md). Here the split
// of `in` is over the 8 blocks of a cluster, whose partial sums meet in distributed shared memory
// behind a cluster barrier.
//
// Algebra (slot s of the one position p, t = token_order[p]; slice j with columns
// [c_lo_j, c_hi_j) = [out_offsets[j], out_offsets[j + 1]) and rank r_j = ranks[s, j], 0 where the
// slice has no columns):
//   v[j, r]  = scaling[s, j] * sum over the cluster's blocks b of x[t, K_b] . A[s, j, r, K_b]  (fp32)
//   y[t, c] += v[j, :r_j] . B[s, c, :r_j]                           (c in [c_lo_j, c_hi_j), fp32)
// y keeps its bits where the delta is exactly zero; nothing is written for slot 0 (no adapter) or
// a slot whose ranks are all zero. v and its scaling stay in fp32: v is not rounded to T before the
// expand (the tensor-core kernels round it to feed the MMA).
// Grid (1-D, 128 threads, clusters of ONE_CLUSTER blocks): every cluster computes the whole v (block
// b of a cluster sums its 1/8 share of `in` in 16-byte pieces: 16-bit types on tensor cores, the
// warps splitting the share; fp32 on CUDA cores, the warps splitting the rows; see one_shrink), so no
// cluster waits on another; block g of the grid
// then writes its 1/grid share of the columns, a thread a column (its B row, r_j ranks, 16-byte
// pieces). The plan sizes the grid by the columns (about ONE_COLS a block, at most
// ONE_MAX_CLUSTERS clusters).
// With EARLY_READS the ALIGNED 16-bit instantiation copies its block's share of A into shared memory
// by the bulk copy engine (a copy a row, one mbarrier) before it waits for the grid before
// (one_stage_a), so after the wait only x comes from global memory for the shrink; otherwise A's
// share is sent towards L2 then (one_prefetch_a). (Staged by 16-byte cp.async instead, the block
// asked L2 for twice the sectors and a call after a flush ran 1.5 us slower: NOTES.md.)
// Shapes: any `in`, out, rank up to RW (16, 64 or 128: the pool's rank width), up to 8 slices,
// every 16-bit and 32-bit type; ALIGNED (flags == 7) drops the element-wise loads of x, A and B.
// sm_90 only (clusters); the plan never asks for it on an older device. The plan's default
// (backends/cupy.py, default_one) takes it where a block's eighth of A is small (one_max_share: 64 KB
// in the 16-bit types, 56 KB in fp32): a cluster's 8 blocks read all of the slot's A, where lora_chunk
// and lora_fused spread it over every multiprocessor, so a larger A (rank 64 at in = 14336, or over
// q/k/v's three slices) runs slower here (NOTES.md, "lora_one", "lora_one on tensor cores").
#pragma once

namespace lora {

constexpr int ONE_CLUSTER = 8;  // blocks a cluster: each sums an eighth of `in`
constexpr int ONE_SLICES = 8;   // slices a target (the backend's MAX_SLICES)

// The step's one position as every block of the launch reads it.
struct OneStep {
  int slot, row;                          // its slot (0: none), its row of x and y
  int rank[ONE_SLICES];                   // r_j: 0 past n and where a slice has no columns
  float scale[ONE_SLICES];
  int off[ONE_SLICES + 1];                // column offsets of the slices
  // the slot's rows over every slice (one_rowmap's, one_stage_a's and one_shrink's q < rows)
  __device__ __forceinline__ int rows(int n) const {
    int q = 0;
    for (int j = 0; j < n; ++j) q += rank[j];
    return q;
  }
};

// Block b's share of `in` in one_shrink: 16-byte pieces [p0, p1), `per` a block (the last ones' cut
// at `in`, or empty).
struct OneShare {
  int p0, p1, per;
};
template <typename T>
__device__ __forceinline__ OneShare one_share(const Args<T>& g, int b) {
  constexpr int CH = 16 / sizeof(T);
  const int pieces = (g.in_features + CH - 1) / CH, per = (pieces + ONE_CLUSTER - 1) / ONE_CLUSTER;
  return {min(pieces, b * per), min(pieces, b * per + per), per};
}

// Distributed shared memory and the cluster barrier (sm_90). The host check supplies its own.
#ifndef LORA_HOST_EMULATION
__device__ __forceinline__ int cluster_rank() {
  unsigned r = 0;
#if __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return int(r);
}
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// part[e] of the cluster's block `peer` (part: the address of the same array in this block)
__device__ __forceinline__ float cluster_load(const float* part, int peer, int e) {
  float v = 0.f;
#if __CUDA_ARCH__ >= 900
  unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(part + e)), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(peer));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
}
#endif

// The 16 bytes of T at p as floats, elements from `valid` on zero (never multiplied: a weight
// past a rank or `in` may be NaN). `vec`: p is 16-byte aligned and the piece may be read whole.
template <typename T, bool VEC>
__device__ __forceinline__ void one_piece(const T* p, int valid, bool vec, float (&f)[16 / sizeof(T)]) {
  constexpr int CH = 16 / sizeof(T);
  if (VEC || vec) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < CH; ++i) f[i] = i < valid ? to_float(e[i]) : 0.f;
  } else {
#pragma unroll
    for (int i = 0; i < CH; ++i) f[i] = i < valid ? to_float(p[i]) : 0.f;
  }
}

// The position's slot and row, its slices' ranks, scalings and offsets, and three barriers: one
// round of loads where the slot is below 1 + blockDim.x (each thread loads the ranks and scalings
// of its first slot beside slot_indptr, so the thread that finds the slot has them), two above.
// False where there is nothing to add (no adapter, or every rank zero): the same answer in every
// block, so a cluster leaves whole.
template <typename T>
__device__ bool one_setup(const Args<T>& g, OneStep& st) {
  const int tid = threadIdx.x, S = g.num_slots, n = g.n_slices;
  const int s1 = 1 + tid;  // this thread's first slot (slot 0 is no adapter)
  int rk[ONE_SLICES];
  float sc[ONE_SLICES];
#pragma unroll
  for (int j = 0; j < ONE_SLICES; ++j) {
    const bool on = s1 < S && j < n;
    rk[j] = on ? g.ranks[s1 * n + j] : 0;
    sc[j] = on ? g.scaling[s1 * n + j] : 0.f;
  }
  int found = 0;
  for (int s = s1; s < S; s += blockDim.x)
    if (g.slot_indptr[s + 1] > g.slot_indptr[s]) found = s;
  const int off = tid <= n ? (n > 1 ? g.out_offsets[tid] : (tid == 0 ? 0 : g.out_features)) : 0;
  const int row = tid == 0 ? g.token_order[0] : 0;
  if (tid == 0) st.slot = 0;
  __syncthreads();
  if (found) st.slot = found;  // one slot holds the step's one position
  if (found && found == s1) {  // its ranks and scalings as loaded (checked below)
#pragma unroll
    for (int j = 0; j < ONE_SLICES; ++j) {
      st.rank[j] = rk[j];
      st.scale[j] = sc[j];
    }
  }
  if (tid <= n) st.off[tid] = off;
  if (tid == 0) st.row = row;
  __syncthreads();
  const int s = st.slot;
  if (s == 0) return false;
  const bool second = s >= 1 + int(blockDim.x);  // past every thread's first slot: a round of its own
  int r = 0;
  float scale = 0.f;
  if (tid < n && st.off[tid + 1] > st.off[tid]) {
    r = min(max(second ? g.ranks[s * n + tid] : st.rank[tid], 0), g.rank_cap());
    scale = second ? g.scaling[s * n + tid] : st.scale[tid];
  }
  __syncthreads();  // every thread has read st.rank and st.scale before they are rewritten
  if (tid < ONE_SLICES) {
    st.rank[tid] = r;  // 0 past n and where a slice has no columns
    st.scale[tid] = scale;
  }
  __syncthreads();
  return st.rows(n) > 0;
}

// Each thread's first ONE_HELD columns of its block (c0 + tid, c0 + tid + blockDim.x), loaded
// before the shrink so their round runs beside the shrink's (rank width 16 and ALIGNED only: 2 x 16
// bytes a column; at wider ranks the held row cost more than it saved, NOTES.md "lora_one variants
// timed"): the B row's pieces below the slice's rank and the column's y. Two columns: gate_up's
// 28672 over 128 blocks are 224 a block.
constexpr int ONE_HELD = 2;
template <typename T, int RW, bool ALIGNED>
struct OneCol {
  static constexpr bool ON = ALIGNED && RW <= 16;
  static constexpr int P = ON ? RW * sizeof(T) / 16 : 1;
  uint4 b[ONE_HELD][P];
  T y[ONE_HELD];
};
template <typename T, int RW, bool ALIGNED>
__device__ __forceinline__ void one_prefetch(const Args<T>& g, const OneStep& st, int blk, int blocks,
                                             OneCol<T, RW, ALIGNED>& pc) {
  if constexpr (OneCol<T, RW, ALIGNED>::ON) {
    constexpr int CH = 16 / sizeof(T);
    const int out = g.out_features, n = g.n_slices;
    const int per = (out + blocks - 1) / blocks, c0 = blk * per, c1 = min(out, c0 + per);
#pragma unroll
    for (int h = 0; h < ONE_HELD; ++h) {
      const int c = c0 + int(threadIdx.x) + h * int(blockDim.x);
      if (c >= c1) break;
      int j = 0;
      while (j + 1 < n && c >= st.off[j + 1]) ++j;
      const int rj = st.rank[j];
      const T* bs = g.B + (size_t)st.slot * g.b_slot;
#pragma unroll
      for (int p = 0; p < OneCol<T, RW, ALIGNED>::P; ++p)
        pc.b[h][p] = p * CH < rj ? *reinterpret_cast<const uint4*>(bs + g.b_at(c, p * CH)) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}
// ... and their y (after the wait for the grid before: y may be that grid's output).
template <typename T, int RW, bool ALIGNED>
__device__ __forceinline__ void one_prefetch_y(const Args<T>& g, const OneStep& st, int blk, int blocks,
                                               OneCol<T, RW, ALIGNED>& pc) {
  if constexpr (OneCol<T, RW, ALIGNED>::ON) {
    const int out = g.out_features;
    const int per = (out + blocks - 1) / blocks, c0 = blk * per, c1 = min(out, c0 + per);
#pragma unroll
    for (int h = 0; h < ONE_HELD; ++h) {
      const int c = c0 + int(threadIdx.x) + h * int(blockDim.x);
      if (c < c1) pc.y[h] = g.y[(size_t)st.row * out + c];
    }
  }
}

// The A rows block b of the cluster reads (one_shrink's share of `in`) sent towards L2, one
// 128-byte line a request, while the grid before this one finishes (EARLY_READS only).
template <typename T>
__device__ __forceinline__ void one_prefetch_a(const Args<T>& g, const OneStep& st, int b) {
  constexpr int CH = 16 / sizeof(T), LINE = 128 / sizeof(T);
  const int in = g.in_features, n = g.n_slices, R = g.max_rank;
  const OneShare sh = one_share(g, b);
  const int k0 = min(in, sh.p0 * CH), k1 = min(in, sh.p1 * CH);
  if (k1 <= k0) return;
  const int lines = (k1 - 1) / LINE - k0 / LINE + 1, rows = st.rows(n);
  const T* as = g.A + (size_t)st.slot * n * R * in;
  for (int i = threadIdx.x; i < rows * lines; i += blockDim.x) {
    int q = i / lines, j = 0;
    while (j < n && q >= st.rank[j]) q -= st.rank[j++];
    const T* p = as + ((size_t)j * R + q) * in + k0 + (size_t)(i % lines) * LINE;
#if defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
    (void)p;  // the host check runs the index arithmetic only
#endif
  }
}

// Block b's share of A staged in shared memory before the wait for the grid before (EARLY_READS,
// ALIGNED, 16-bit types): A does not depend on that grid, so after the wait the shrink reads only
// x's share from global memory and A's rows from shared memory (without it, one_prefetch_a sends the
// rows towards L2 and the shrink reads them from there after the wait). Row q of the slot's rows (the slices in
// order, r < r_j: one_rowmap's order) at q * ld, its pieces from the share's first; ld, the share's
// pieces rounded up to 128 bytes and 64 more, puts rows g and g + 1 of a 16-byte load's 8-lane phase
// in distinct banks. The plan gives the launch one_stage_smem's bytes (every slice at the rank width).
template <typename T>
__device__ __forceinline__ int one_stage_ld(int per_b) {
  return ((per_b * 16 + 127) / 128 * 128 + 64) / int(sizeof(T));
}
// The block's copies of its rows (one_stage_a) complete the phase of an mbarrier of blockDim.x
// arrivals (mbar_init before one_setup's barrier; each thread arrives once, with its copies' bytes).
// The host check supplies its own (host_cuda.h).
#ifndef LORA_HOST_EMULATION
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// this thread's arrival, with the bytes its copies (issued after it) will bring
__device__ __forceinline__ void mbar_arrive_tx(unsigned long long* bar, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
#endif
}
// `bytes` (a multiple of 16) from global src to shared dst (both 16-byte aligned) by the bulk copy
// engine, counted against bar
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
#endif
}
// until bar's phase of this parity has completed
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n\t.reg .pred p;\n\tLORA_MBAR_WAIT%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
      "@!p bra LORA_MBAR_WAIT%=;\n\t}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
#endif
}
#endif

// Issues the copies, a row a copy by the bulk copy engine (thread i the rows i, i + blockDim.x, ...),
// every thread arriving on bar once; false, with nothing issued and no arrival, where the launch's
// dynamic shared memory cannot hold the slot's rows (the same in every thread).
template <typename T>
__device__ bool one_stage_a(const Args<T>& g, const OneStep& st, int b, T* sa, unsigned long long* bar) {
  constexpr int CH = 16 / sizeof(T);
  const int in = g.in_features, n = g.n_slices, R = g.max_rank;
  const OneShare sh = one_share(g, b);
  const int np = sh.p1 - sh.p0, ld = one_stage_ld<T>(sh.per), rows = st.rows(n);
  if ((size_t)rows * ld * sizeof(T) > dynamic_smem_size()) return false;
  const T* as = g.A + (size_t)st.slot * n * R * in + (size_t)sh.p0 * CH;
  const int mine = np > 0 && (int)threadIdx.x < rows ? (rows - 1 - (int)threadIdx.x) / (int)blockDim.x + 1 : 0;
  mbar_arrive_tx(bar, unsigned(mine * np * 16));
  int j = 0, first = 0;  // the slice of the row, and its first row
  for (int i = 0, row = threadIdx.x; i < mine; ++i, row += blockDim.x) {
    while (j < n && row - first >= st.rank[j]) first += st.rank[j++];
    bulk_copy(sa + (size_t)row * ld, as + ((size_t)j * R + (row - first)) * in, unsigned(np * 16), bar);
  }
  return true;
}

// The 16 bytes of T at p, elements from `valid` on zeroed in their bits (0.0 in every type; a
// weight past a rank or `in` may be NaN and is never multiplied). `vec`: p is 16-byte aligned.
template <typename T, bool VEC>
__device__ __forceinline__ uint4 one_raw(const T* p, int valid, bool vec) {
  constexpr int CH = 16 / sizeof(T);
  if (VEC || vec) {
    uint4 u = *reinterpret_cast<const uint4*>(p);
    if (!VEC && valid < CH) {
      T* e = reinterpret_cast<T*>(&u);
#pragma unroll
      for (int i = 0; i < CH; ++i)
        if (i >= valid) e[i] = from_float<T>(0.f);
    }
    return u;
  }
  uint4 u = make_uint4(0u, 0u, 0u, 0u);
  T* e = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int i = 0; i < CH; ++i)
    if (i < valid) e[i] = p[i];
  return u;
}

// ---- The shrink on tensor cores (16-bit types) -------------------------------------------------
// One position's x . A as m16n8k16 MMAs: A's rows (the slot's rows over every slice, 16 a tile) are
// the MMA's A operand, x its B operand, the same x in each of the 8 columns (so every column of D,
// and every lane, holds its two rows' sums). A lane reads one 16-byte piece of each of its two rows
// of a tile and the same piece of x: k is permuted inside each 32 features, lane 4 g + t's piece
// p = 4 Q + t of a quad Q feeds logical k {2t, 2t+1, 2t+8, 2t+9} of two MMAs from its elements 0-3
// and 4-7; a product is exact whatever the order, as A and x are permuted alike. In place of the
// CUDA-core shrink, whose instructions (the conversions of every element, the index arithmetic of
// every row) were what a call of one position waited on (NOTES.md, "lora_one on tensor cores").
constexpr int ONE_WARPS = 4;  // warps a block (blocks of 128 threads)

// rowmap[q] = j * RW + r for the block's q-th row (the slices in order, r < r_j), q < rows
template <int RW, typename St>
__device__ __forceinline__ void one_rowmap(int n, const St& st, short* rowmap, int rows) {
  for (int q = threadIdx.x; q < rows; q += blockDim.x) {
    int r = q, j = 0;
    while (j + 1 < n && r >= st.rank[j]) r -= st.rank[j++];
    rowmap[q] = short(j * RW + r);
  }
}

// out(q, sum) for every row q < rows: this warp's sum over its quads of x[t] . A row q. Warp w takes
// the share's quads (4 pieces) w, w + 4, ..., QB of them a round, and the row tiles MG at a time. xr:
// the position's row of x, in every column of the MMA's B; only column 0 of D is written (lanes t = 0).
// STAGED: `as` is the block's share of A in shared memory (one_stage_a: row q at q * ld, from piece p0).
template <typename T, int RW, bool ALIGNED, int MG, int QB, bool STAGED, typename Out>
__device__ void one_mma_rows(const Args<T>& g, const T* xr, const T* as, const short* rowmap, int rows, int p0,
                             int p1, Out out, int ld) {
  constexpr int CH = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
  const int in = g.in_features, R = g.max_rank, kb = STAGED ? p0 * CH : 0;
  const bool vec = ALIGNED || (g.flags & 1);
  const int quads = (max(p1 - p0, 0) + 3) / 4, tiles = (rows + 15) / 16;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int m0 = 0; m0 < tiles; m0 += MG) {
    const T* ar[MG][2];
    bool on[MG][2];
#pragma unroll
    for (int mi = 0; mi < MG; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int q = (m0 + mi) * 16 + gq + 8 * h, pr = q < rows ? rowmap[q] : 0;
        on[mi][h] = q < rows;
        ar[mi][h] = STAGED ? as + (size_t)(q < rows ? q : 0) * ld : as + (size_t)((pr / RW) * R + pr % RW) * in;
      }
    float d[MG][4] = {};
    for (int q0 = warp; q0 < quads; q0 += ONE_WARPS * QB) {
      uint4 xv[QB], av[MG][2][QB];
#pragma unroll
      for (int i = 0; i < QB; ++i) {  // the round's loads ...
        const int p = p0 + 4 * (q0 + ONE_WARPS * i) + t, k = p * CH;
        const int valid = q0 + ONE_WARPS * i < quads && p < p1 ? (ALIGNED ? CH : min(CH, in - k)) : 0;
        xv[i] = valid > 0 ? one_raw<T, ALIGNED>(xr + k, valid, vec) : zero;
#pragma unroll
        for (int mi = 0; mi < MG; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            av[mi][h][i] = valid > 0 && on[mi][h] ? one_raw<T, ALIGNED>(ar[mi][h] + (k - kb), valid, vec) : zero;
      }
#pragma unroll
      for (int i = 0; i < QB; ++i) {  // ... then its MMAs (the quad the same in the whole warp)
        if (q0 + ONE_WARPS * i >= quads) break;
        const unsigned b0[2] = {xv[i].x, xv[i].y}, b1[2] = {xv[i].z, xv[i].w};
#pragma unroll
        for (int mi = 0; mi < MG; ++mi) {
          const unsigned a0[4] = {av[mi][0][i].x, av[mi][1][i].x, av[mi][0][i].y, av[mi][1][i].y};
          const unsigned a1[4] = {av[mi][0][i].z, av[mi][1][i].z, av[mi][0][i].w, av[mi][1][i].w};
          mma16816<T>(d[mi], a0, b0);
          mma16816<T>(d[mi], a1, b1);
        }
      }
    }
#pragma unroll
    for (int mi = 0; mi < MG; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // D[row][column]: rows gq and gq + 8 of each tile, columns 2t, 2t + 1
        const int q = (m0 + mi) * 16 + gq + 8 * h;
        if (q < rows && t == 0) out(q, d[mi][2 * h]);
      }
  }
}

// part[j * RW + r] = x[t, K_b] . A[s, j, r, K_b] for every row (j, r < r_j) on tensor cores: the
// rows' map, each warp's sums over its quads, then one thread a row adds the 4 warps' sums.
template <typename T, int RW, bool ALIGNED, bool STAGED = false>
__device__ void one_mma_shrink(const Args<T>& g, const OneStep& st, float* part, int rows, int p0, int p1,
                               const T* sa = nullptr, int ld = 0) {
  __shared__ short rowmap[ONE_SLICES * RW];
  __shared__ float wsum[ONE_WARPS * ONE_SLICES * RW];
  one_rowmap<RW>(g.n_slices, st, rowmap, rows);
  __syncthreads();
  const int tiles = (rows + 15) / 16, qw = ((max(p1 - p0, 0) + 3) / 4 + ONE_WARPS - 1) / ONE_WARPS;
  const T* xr = g.x + (size_t)st.row * g.in_features;
  const T* as = STAGED ? sa : g.A + (size_t)st.slot * g.n_slices * g.max_rank * g.in_features;
  float* ws = wsum + (threadIdx.x >> 5) * ONE_SLICES * RW;
  auto out = [&](int q, float v) { ws[q] = v; };
  if (tiles == 1 && qw > 4)  // `in` = 14336: 14 quads a warp
    one_mma_rows<T, RW, ALIGNED, 1, 16, STAGED>(g, xr, as, rowmap, rows, p0, p1, out, ld);
  else if (tiles == 1)
    one_mma_rows<T, RW, ALIGNED, 1, 4, STAGED>(g, xr, as, rowmap, rows, p0, p1, out, ld);
  else if (tiles == 2)
    one_mma_rows<T, RW, ALIGNED, 2, 4, STAGED>(g, xr, as, rowmap, rows, p0, p1, out, ld);
  else
    one_mma_rows<T, RW, ALIGNED, 4, 4, STAGED>(g, xr, as, rowmap, rows, p0, p1, out, ld);
  __syncthreads();
  for (int q = threadIdx.x; q < rows; q += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < ONE_WARPS; ++w) s += wsum[w * ONE_SLICES * RW + q];
    part[rowmap[q]] = s;
  }
}

// ---- The shrink on CUDA cores (fp32) ------------------------------------------------------------
// acc += the dot of two 16-byte pieces of T, in fp32
template <typename T>
__device__ __forceinline__ float one_dot(const uint4& a, const uint4& b, float acc) {
  constexpr int CH = 16 / sizeof(T);
  const T* ea = reinterpret_cast<const T*>(&a);
  const T* eb = reinterpret_cast<const T*>(&b);
#pragma unroll
  for (int i = 0; i < CH; ++i) acc = fmaf(to_float(ea[i]), to_float(eb[i]), acc);
  return acc;
}

// one_shrink's work for one warp: its rows [q0, q1) ROWS at a time, and of each row the pieces of
// the share [p0, p1) that are lane l's (l, l + 32, ...) NP at a time: every load of a round (NP
// pieces of x and of each of ROWS rows) issued before its first FMA; one shuffle butterfly a row.
template <typename T, int RW, bool ALIGNED, int ROWS, int NP>
__device__ void one_shrink_rows(const Args<T>& g, const OneStep& st, float* part, int q0, int q1, int p0,
                                int p1) {
  constexpr int CH = 16 / sizeof(T);
  const int in = g.in_features, n = g.n_slices, R = g.max_rank, lane = threadIdx.x & 31;
  const bool vec = ALIGNED || (g.flags & 1);
  const T* xr = g.x + (size_t)st.row * in;
  const T* as = g.A + (size_t)st.slot * n * R * in;
  for (; q0 < q1; q0 += ROWS) {
    const T* ar[ROWS];
    int at[ROWS];  // part's index of each row, -1 past the warp's rows
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
      int q = q0 + u, j = 0;
      while (j < n && q >= st.rank[j]) q -= st.rank[j++];
      const bool on = q0 + u < q1 && j < n;
      ar[u] = on ? as + ((size_t)j * R + q) * in : as;
      at[u] = on ? j * RW + q : -1;
    }
    float acc[ROWS] = {};
    for (int pb = p0 + lane; pb < p1; pb += 32 * NP) {
      uint4 xp[NP], ap[ROWS][NP];
#pragma unroll
      for (int i = 0; i < NP; ++i) {  // the round's loads ...
        const int p = pb + 32 * i, k = p * CH, valid = p < p1 ? (ALIGNED ? CH : min(CH, in - k)) : 0;
        xp[i] = valid > 0 ? one_raw<T, ALIGNED>(xr + k, valid, vec) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < ROWS; ++u)
          ap[u][i] = valid > 0 && at[u] >= 0 ? one_raw<T, ALIGNED>(ar[u] + k, valid, vec) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int i = 0; i < NP; ++i) {  // ... then its FMAs
        if (pb + 32 * i >= p1) break;
#pragma unroll
        for (int u = 0; u < ROWS; ++u) acc[u] = one_dot<T>(xp[i], ap[u][i], acc[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < ROWS; ++u) {
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) acc[u] += __shfl_xor_sync(0xffffffffu, acc[u], m);
      if (lane == 0 && at[u] >= 0) part[at[u]] = acc[u];
    }
  }
}

// part[j * RW + r] = x[t, K_b] . A[s, j, r, K_b] for every row (j, r < r_j), K_b the share of `in`
// of the cluster's block b (16-byte pieces split in eighths). 16-bit types on tensor cores
// (one_mma_shrink); fp32 on CUDA cores, the rows dealt evenly to the warps (warp w the rows
// [w * per, w * per + per)) and the round's shape following the rows a warp has and the pieces a
// lane has: up to ONE_LOADS 16-byte loads a lane before the first FMA (4 rows x 8 pieces, 8 x 4, and
// 2 pieces at 4, 8 or 12 rows); more take more rounds.
constexpr int ONE_LOADS = 40;
// sa: where not null, the share of A that one_stage_a copied into shared memory (every row landed:
// each thread has waited on its mbarrier).
template <typename T, int RW, bool ALIGNED>
__device__ void one_shrink(const Args<T>& g, const OneStep& st, float* part, int b, const T* sa = nullptr) {
  const OneShare sh = one_share(g, b);
  const int p0 = sh.p0, p1 = sh.p1, per_b = sh.per, rows = st.rows(g.n_slices);
  if constexpr (sizeof(T) == 2) {
    if constexpr (ALIGNED) {
      if (sa != nullptr) {
        one_mma_shrink<T, RW, ALIGNED, true>(g, st, part, rows, p0, p1, sa, one_stage_ld<T>(per_b));
        return;
      }
    }
    one_mma_shrink<T, RW, ALIGNED>(g, st, part, rows, p0, p1);
  } else {
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int per = (rows + warps - 1) / warps, q0 = warp * per, q1 = min(rows, q0 + per);
    if (q0 >= q1) return;  // a share past `in` still writes its rows' zeros
    const int lp = (p1 - p0 + 31) / 32;  // pieces a lane (p1 <= p0: none, the rows' zeros)
    if (per <= 4 && lp <= 2)
      one_shrink_rows<T, RW, ALIGNED, 4, 2>(g, st, part, q0, q1, p0, p1);
    else if (per <= 4)
      one_shrink_rows<T, RW, ALIGNED, 4, ONE_LOADS / 5>(g, st, part, q0, q1, p0, p1);
    else if (per <= 8 && lp <= 2)
      one_shrink_rows<T, RW, ALIGNED, 8, 2>(g, st, part, q0, q1, p0, p1);
    else if (per <= 8)
      one_shrink_rows<T, RW, ALIGNED, 8, ONE_LOADS / 9>(g, st, part, q0, q1, p0, p1);
    else
      one_shrink_rows<T, RW, ALIGNED, 12, 2>(g, st, part, q0, q1, p0, p1);
  }
}

// vs[j * RW + r] = scaling * the cluster's sum of part (peer(b, e): block b's part[e]), 0 past r_j.
template <int RW, typename Peer>
__device__ __forceinline__ void one_sum(int n, const OneStep& st, float* vs, Peer peer) {
  for (int e = threadIdx.x; e < n * RW; e += blockDim.x) {
    const int j = e / RW, r = e % RW;
    float s = 0.f;
    if (r < st.rank[j]) {
#pragma unroll
      for (int b = 0; b < ONE_CLUSTER; ++b) s += peer(b, e);
      s *= st.scale[j];
    }
    vs[e] = s;
  }
}

// y[t, c] += vs[j, :r_j] . B[s, c, :r_j] for the columns of block `blk` of `blocks` (a thread a
// column; its first ONE_HELD columns' B rows and y from one_prefetch where it loaded them).
template <typename T, int RW, bool ALIGNED>
__device__ void one_expand(const Args<T>& g, const OneStep& st, const float* vs, int blk, int blocks,
                           const OneCol<T, RW, ALIGNED>& pc) {
  constexpr int CH = 16 / sizeof(T);
  constexpr bool HELD = OneCol<T, RW, ALIGNED>::ON;
  const int out = g.out_features, n = g.n_slices;
  const int per = (out + blocks - 1) / blocks, c0 = blk * per, c1 = min(out, c0 + per);
  const bool vec = ALIGNED || (g.flags & 2);
  const T* bs = g.B + (size_t)st.slot * g.b_slot;
  T* yr = g.y + (size_t)st.row * out;
  // column c; held: its B row's pieces and y as one_prefetch loaded them (h a constant once unrolled)
  auto column = [&](int c, const uint4* held, const T* held_y) {
    int j = 0;
    while (j + 1 < n && c >= st.off[j + 1]) ++j;
    const int rj = st.rank[j];
    if (rj == 0) return;
    const float* vj = vs + j * RW;
    float d = 0.f;
#pragma unroll
    for (int p = 0; p < RW / CH; ++p) {
      if (p * CH >= rj) break;
      float bf[CH];
      if (held) {
        const T* e = reinterpret_cast<const T*>(&held[HELD ? p : 0]);
#pragma unroll
        for (int i = 0; i < CH; ++i) bf[i] = p * CH + i < rj ? to_float(e[i]) : 0.f;
      } else {
        one_piece<T, ALIGNED>(bs + g.b_at(c, p * CH), min(CH, rj - p * CH), vec, bf);
      }
#pragma unroll
      for (int i = 0; i < CH; ++i) d = fmaf(bf[i], vj[p * CH + i], d);
    }
    const T y0 = held ? *held_y : yr[c];
    if (d != 0.f) yr[c] = from_float<T>(to_float(y0) + d);
  };
  int c = c0 + int(threadIdx.x);
  if constexpr (HELD) {
#pragma unroll
    for (int h = 0; h < ONE_HELD; ++h, c += blockDim.x)
      if (c < c1) column(c, pc.b[h], &pc.y[h]);
  }
  for (; c < c1; c += blockDim.x) column(c, nullptr, nullptr);
}

}  // namespace lora
