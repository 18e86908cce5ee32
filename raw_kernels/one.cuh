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
constexpr int ONE_ROWS = 4;     // rows (slice, rank) a warp sums at once in chunks (one_chunk_shrink)

// The step's one position as every block of the launch reads it.
struct OneStep {
  int slot, row;                          // its slot (0: none), its row of x and y
  int rank[ONE_SLICES];                   // r_j: 0 past n and where a slice has no columns
  float scale[ONE_SLICES];
  int off[ONE_SLICES + 1];                // column offsets of the slices
};

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
// float4 i of `part` of the cluster's block `peer` (part 16-byte aligned)
__device__ __forceinline__ float4 cluster_load4(const float* part, int peer, int i) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
  unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(part + 4 * i)), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(peer));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
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
  int rows = 0;
  for (int j = 0; j < n; ++j) rows += st.rank[j];
  return rows > 0;
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
    const int out = g.out_features, n = g.n_slices, R = g.max_rank;
    const int per = (out + blocks - 1) / blocks, c0 = blk * per, c1 = min(out, c0 + per);
#pragma unroll
    for (int h = 0; h < ONE_HELD; ++h) {
      const int c = c0 + int(threadIdx.x) + h * int(blockDim.x);
      if (c >= c1) break;
      int j = 0;
      while (j + 1 < n && c >= st.off[j + 1]) ++j;
      const int rj = st.rank[j];
      const T* br = g.B + (size_t)st.slot * g.b_slot + (size_t)c * R;
#pragma unroll
      for (int p = 0; p < OneCol<T, RW, ALIGNED>::P; ++p)
        pc.b[h][p] = p * CH < rj ? *reinterpret_cast<const uint4*>(br + p * CH) : make_uint4(0u, 0u, 0u, 0u);
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
  const int pieces = (in + CH - 1) / CH, per = (pieces + ONE_CLUSTER - 1) / ONE_CLUSTER;
  const int k0 = min(in, b * per * CH), k1 = min(in, (b * per + per) * CH);
  if (k1 <= k0) return;
  const int lines = (k1 - 1) / LINE - k0 / LINE + 1;
  const T* as = g.A + (size_t)st.slot * n * R * in;
  int rows = 0;
  for (int j = 0; j < n; ++j) rows += st.rank[j];
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

// out(q, i, sum) for every row q < rows and position i < m: this warp's sum over its quads of
// x[t_i] . A row q. Warp w takes the share's quads (4 pieces) w, w + 4, ..., QB of them a round, and
// the row tiles MG at a time. xr: the lane's row of x, that of position g (lane 4 g + t; at M = 1 the
// one position in every column), nullptr past the chunk's m positions (its column of B is zero).
// At M = 1 only column 0 is written (lanes t = 0); at M > 1 lane 4 g + t has positions 2t and 2t + 1.
template <typename T, int RW, bool ALIGNED, int MG, int QB, int M, typename Out>
__device__ void one_mma_rows(const Args<T>& g, const T* xr, const T* as, const short* rowmap, int rows, int m,
                             int p0, int p1, Out out) {
  constexpr int CH = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
  const int in = g.in_features, R = g.max_rank;
  const bool vec = ALIGNED || (g.flags & 1), xon = M == 1 || xr != nullptr;
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
        ar[mi][h] = as + (size_t)((pr / RW) * R + pr % RW) * in;
      }
    float d[MG][4] = {};
    for (int q0 = warp; q0 < quads; q0 += ONE_WARPS * QB) {
      uint4 xv[QB], av[MG][2][QB];
#pragma unroll
      for (int i = 0; i < QB; ++i) {  // the round's loads ...
        const int p = p0 + 4 * (q0 + ONE_WARPS * i) + t, k = p * CH;
        const int valid = q0 + ONE_WARPS * i < quads && p < p1 ? (ALIGNED ? CH : min(CH, in - k)) : 0;
        xv[i] = valid > 0 && xon ? one_raw<T, ALIGNED>(xr + k, valid, vec) : zero;
#pragma unroll
        for (int mi = 0; mi < MG; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            av[mi][h][i] = valid > 0 && on[mi][h] ? one_raw<T, ALIGNED>(ar[mi][h] + k, valid, vec) : zero;
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
        if (q >= rows) continue;
        if constexpr (M == 1) {
          if (t == 0) out(q, 0, d[mi][2 * h]);
        } else {
#pragma unroll
          for (int c = 0; c < 2; ++c)
            if (2 * t + c < m) out(q, 2 * t + c, d[mi][2 * h + c]);
        }
      }
  }
}

// part[j * RW + r] = x[t, K_b] . A[s, j, r, K_b] for every row (j, r < r_j) on tensor cores: the
// rows' map, each warp's sums over its quads, then one thread a row adds the 4 warps' sums.
template <typename T, int RW, bool ALIGNED>
__device__ void one_mma_shrink(const Args<T>& g, const OneStep& st, float* part, int rows, int p0, int p1) {
  __shared__ short rowmap[ONE_SLICES * RW];
  __shared__ float wsum[ONE_WARPS * ONE_SLICES * RW];
  one_rowmap<RW>(g.n_slices, st, rowmap, rows);
  __syncthreads();
  const int tiles = (rows + 15) / 16, qw = ((max(p1 - p0, 0) + 3) / 4 + ONE_WARPS - 1) / ONE_WARPS;
  const T* xr = g.x + (size_t)st.row * g.in_features;
  const T* as = g.A + (size_t)st.slot * g.n_slices * g.max_rank * g.in_features;
  float* ws = wsum + (threadIdx.x >> 5) * ONE_SLICES * RW;
  auto out = [&](int q, int, float v) { ws[q] = v; };
  if (tiles == 1 && qw > 4)  // `in` = 14336: 14 quads a warp
    one_mma_rows<T, RW, ALIGNED, 1, 16, 1>(g, xr, as, rowmap, rows, 1, p0, p1, out);
  else if (tiles == 1)
    one_mma_rows<T, RW, ALIGNED, 1, 4, 1>(g, xr, as, rowmap, rows, 1, p0, p1, out);
  else if (tiles == 2)
    one_mma_rows<T, RW, ALIGNED, 2, 4, 1>(g, xr, as, rowmap, rows, 1, p0, p1, out);
  else
    one_mma_rows<T, RW, ALIGNED, 4, 4, 1>(g, xr, as, rowmap, rows, 1, p0, p1, out);
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
template <typename T, int RW, bool ALIGNED>
__device__ void one_shrink(const Args<T>& g, const OneStep& st, float* part, int b) {
  constexpr int CH = 16 / sizeof(T);
  const int in = g.in_features, n = g.n_slices;
  const int pieces = (in + CH - 1) / CH, per_b = (pieces + ONE_CLUSTER - 1) / ONE_CLUSTER;
  const int p0 = b * per_b, p1 = min(pieces, p0 + per_b);
  int rows = 0;
  for (int j = 0; j < n; ++j) rows += st.rank[j];
  if constexpr (sizeof(T) == 2) {
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
  const int out = g.out_features, n = g.n_slices, R = g.max_rank;
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
    const T* br = bs + (size_t)c * R;
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
        one_piece<T, ALIGNED>(br + p * CH, min(CH, rj - p * CH), vec, bf);
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

// ---- Chunks of several positions (the decode buckets of 2 to 256 positions) ------------------------
// lora_one<T, RW, ALIGNED, ONE_M> runs the same cluster scheme over a step's chunks: slot s's positions
// cut into pieces of at most ONE_M from its start (count_chunks / locate_chunk, lora_mma.cu). A
// cluster's item is (chunk, share): its 8 blocks sum their eighths of `in` for every row of the chunk
// (x[t_i, K_b] . A[s, j, r, K_b] for each of the chunk's m positions i), meet in distributed shared
// memory, and block b writes the share's columns. Where a step has fewer chunks than the grid has
// clusters, each chunk takes clusters / chunks shares of the columns (each cluster sums the chunk's v
// again, from L2). The 16-bit types run both halves on tensor cores with the chunk's 8 positions as
// the MMA's 8 columns (one_chunk_mma_shrink, one_chunk_mma_expand: no tile holding 1-8 of 16 rows,
// as lora_chunk's do); fp32 on CUDA cores (one_chunk_fma_shrink, one_chunk_fma_expand: x staged in
// shared memory, a thread a column). No ticket, no ready counts and no v in global memory.
constexpr int ONE_M = 8;  // positions a chunk (ONE_ROWS * ONE_M = 32: one lane a (row, position))
// Whether a launch in chunks lets the next grid start at once (PDL) rather than as its blocks exit:
// on an H200 the layer of 64 positions over 32 adapters took 89.7 us warm with it and 99.1 without
// (NOTES.md, "lora_one in chunks on tensor cores").
constexpr bool ONE_CHUNK_RELEASE = true;

template <int M>
struct OneChunk {
  int slot, m;                            // the chunk's slot (>= 1) and its positions
  int row[M];                             // their rows of x and y
  int rank[ONE_SLICES];                   // r_j: 0 past n and where a slice has no columns
  float scale[ONE_SLICES];
  int off[ONE_SLICES + 1];                // column offsets of the slices
};

// Chunk c (< cs.chunks, after count_chunks): its slot, rows, and the slot's ranks and scalings, one
// round of loads after the chunk is found. False where every rank is zero (the same in every block).
template <typename T, int M>
__device__ bool one_chunk_setup(const Args<T>& g, const int* s_indptr, ChunkScan& cs, OneChunk<M>& st, int c) {
  locate_chunk<M>(cs, s_indptr, g.num_slots, g.positions, c);
  const int tid = threadIdx.x, n = g.n_slices, p0 = cs.chunk[0], m = cs.chunk[1], s = cs.chunk[2];
  if (tid < M) st.row[tid] = tid < m ? g.token_order[p0 + tid] : 0;
  if (tid >= 32 && tid < 32 + ONE_SLICES) {
    const int j = tid - 32;
    int r = 0;
    float sc = 0.f;
    if (j < n) {
      const int lo = n > 1 ? g.out_offsets[j] : 0, hi = n > 1 ? g.out_offsets[j + 1] : g.out_features;
      const int rr = g.ranks[s * n + j];
      const float ss = g.scaling[s * n + j];
      if (hi > lo) {
        r = min(max(rr, 0), g.rank_cap());
        sc = ss;
      }
    }
    st.rank[j] = r;
    st.scale[j] = sc;
  }
  if (tid >= 64 && tid <= 64 + n) st.off[tid - 64] = n > 1 ? g.out_offsets[tid - 64] : (tid == 64 ? 0 : g.out_features);
  if (tid == 0) {
    st.slot = s;
    st.m = m;
  }
  __syncthreads();
  int rows = 0;
  for (int j = 0; j < n; ++j) rows += st.rank[j];
  return rows > 0;
}

// part[i * W + j * RW + r] = x[t_i, K_b] . A[s, j, r, K_b] (W = n * RW) for the chunk's positions
// i < m and rows (j, r < r_j): warp w takes ONE_ROWS rows of A at a time, lane l the pieces l, l + 32,
// ... of block b's share of `in`; each piece of A is read once for the m positions. The 32 sums of a
// warp (ONE_ROWS rows x ONE_M positions) are reduced across the lanes by halving exchanges (31
// shuffles; lane l ends with sum l), not one butterfly each (160).
// One halving exchange of width W over the lanes (the first 2W sums of acc).
template <int W>
__device__ __forceinline__ void one_halve(float (&acc)[32], int lane) {
  const bool upper = lane & W;
#pragma unroll
  for (int i = 0; i < W; ++i) {
    const float keep = upper ? acc[i + W] : acc[i], send = upper ? acc[i] : acc[i + W];
    acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, W);
  }
}

template <typename T, int RW, bool ALIGNED, int M>
__device__ void one_chunk_fma_shrink(const Args<T>& g, const OneChunk<M>& st, float* part, T* xs, int b) {
  static_assert(ONE_ROWS * M == 32, "one lane a (row, position) after the reduction");
  constexpr int CH = 16 / sizeof(T);
  const int in = g.in_features, n = g.n_slices, R = g.max_rank, W = n * RW, m = st.m;
  const int pieces = (in + CH - 1) / CH, per = (pieces + ONE_CLUSTER - 1) / ONE_CLUSTER;
  const int p0 = b * per, p1 = min(pieces, p0 + per), mine = max(p1 - p0, 0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  // the chunk's rows of x over this block's share, staged in shared memory in one round of loads
  // (zero past `in`), so the loop below waits on A alone
  {
    const bool vec = ALIGNED || (g.flags & 1);
    for (int e = threadIdx.x; e < m * mine; e += blockDim.x) {
      const int i = e / mine, k = (p0 + e % mine) * CH;
      const T* src = g.x + (size_t)st.row[i] * in + k;
      uint4 u;
      if (vec && k + CH <= in) {
        u = *reinterpret_cast<const uint4*>(src);
      } else {
        T* d = reinterpret_cast<T*>(&u);
#pragma unroll
        for (int c = 0; c < CH; ++c) d[c] = k + c < in ? src[c] : from_float<T>(0.f);
      }
      *reinterpret_cast<uint4*>(xs + ((size_t)i * per + e % mine) * CH) = u;
    }
  }
  __syncthreads();
  const bool vec = ALIGNED || (g.flags & 1);
  int rows = 0;
  for (int j = 0; j < n; ++j) rows += st.rank[j];
  const T* as = g.A + (size_t)st.slot * n * R * in;
  for (int q0 = warp * ONE_ROWS; q0 < rows; q0 += warps * ONE_ROWS) {
    const T* ar[ONE_ROWS];
    int at[ONE_ROWS];  // the row's index in a position's W, -1 past the rows
#pragma unroll
    for (int u = 0; u < ONE_ROWS; ++u) {
      int q = q0 + u, j = 0;
      while (j < n && q >= st.rank[j]) q -= st.rank[j++];
      const bool on = j < n;
      ar[u] = on ? as + ((size_t)j * R + q) * in : as;
      at[u] = on ? j * RW + q : -1;
    }
    float acc[32] = {};  // acc[u * M + i]
    for (int p = p0 + lane; p < p1; p += 32) {
      const int k = p * CH, valid = ALIGNED ? CH : min(CH, in - k);
      float af[ONE_ROWS][CH];
#pragma unroll
      for (int u = 0; u < ONE_ROWS; ++u) {
        if (at[u] >= 0) {
          one_piece<T, ALIGNED>(ar[u] + k, valid, vec, af[u]);
        } else {
#pragma unroll
          for (int e = 0; e < CH; ++e) af[u][e] = 0.f;
        }
      }
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if (i >= m) break;
        float xf[CH];
        one_piece<T, true>(xs + ((size_t)i * per + (p - p0)) * CH, CH, true, xf);
#pragma unroll
        for (int u = 0; u < ONE_ROWS; ++u)
#pragma unroll
          for (int e = 0; e < CH; ++e) acc[u * M + i] = fmaf(xf[e], af[u][e], acc[u * M + i]);
      }
    }
    // halving exchanges: at width w a lane keeps the half of its first 2w sums its bit w selects
    // and adds its partner's copy of that half; after w = 1, acc[0] is the sum of index `lane`.
    one_halve<16>(acc, lane);
    one_halve<8>(acc, lane);
    one_halve<4>(acc, lane);
    one_halve<2>(acc, lane);
    one_halve<1>(acc, lane);
    // the lane's row found again (at[lane / M] would put `at` in local memory)
    int q = q0 + lane / M, j = 0;
    while (j < n && q >= st.rank[j]) q -= st.rank[j++];
    if (j < n && lane % M < m) part[(lane % M) * W + j * RW + q] = acc[0];
  }
}

// vs[i * W + j * RW + r] = scaling_j * the cluster's sum of part (peer(b, f): float4 f of block b's
// part) for the chunk's positions i < m, 0 past r_j.
template <int RW, int M, typename Peer>
__device__ __forceinline__ void one_chunk_sum(int n, const OneChunk<M>& st, float* vs, Peer peer) {
  const int W = n * RW;
  for (int f = threadIdx.x; f < st.m * W / 4; f += blockDim.x) {
    const int e = 4 * f, j = (e % W) / RW, r = e % RW, rj = st.rank[j];
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < rj) {
#pragma unroll
      for (int b = 0; b < ONE_CLUSTER; ++b) {
        const float4 p = peer(b, f);
        s.x += p.x;
        s.y += p.y;
        s.z += p.z;
        s.w += p.w;
      }
      const float sc = st.scale[j];
      s.x = r < rj ? s.x * sc : 0.f;
      s.y = r + 1 < rj ? s.y * sc : 0.f;
      s.z = r + 2 < rj ? s.z * sc : 0.f;
      s.w = r + 3 < rj ? s.w * sc : 0.f;
    }
    *reinterpret_cast<float4*>(vs + e) = s;
  }
}

// y[t_i, c] += vs[i, j, :r_j] . B[s, c, :r_j] for the chunk's positions i < m and the columns of
// block `blk` of `blocks`: a thread a column, ONE_UNROLL columns (blockDim.x apart) at once, every
// load of B and y of them issued before the first sum, so a thread has their bytes in flight together.
template <int RW>
struct OneUnroll {
  static constexpr int U = RW <= 16 ? 4 : 1;
};
template <typename T, int RW, bool ALIGNED, int M>
__device__ void one_chunk_fma_expand(const Args<T>& g, const OneChunk<M>& st, const float* vs, int blk, int blocks) {
  constexpr int CH = 16 / sizeof(T), P = RW / CH, U = OneUnroll<RW>::U;
  const int out = g.out_features, n = g.n_slices, R = g.max_rank, W = n * RW, m = st.m;
  const int per = (out + blocks - 1) / blocks, c0 = blk * per, c1 = min(out, c0 + per);
  const bool vec = ALIGNED || (g.flags & 2);
  const T* bs = g.B + (size_t)st.slot * g.b_slot;
  for (int cb = c0 + threadIdx.x; cb < c1; cb += U * blockDim.x) {
    int jj[U], rk[U];
    T y0[U][M];
    float d[U][M];
#pragma unroll
    for (int v = 0; v < U; ++v) {
      const int c = cb + v * blockDim.x;
      int j = 0;
      while (j + 1 < n && c >= st.off[j + 1]) ++j;
      jj[v] = j;
      rk[v] = c < c1 ? st.rank[j] : 0;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        d[v][i] = 0.f;
        if (i < m && rk[v] > 0) y0[v][i] = g.y[(size_t)st.row[i] * out + c];
      }
    }
    uint4 braw[ALIGNED ? U : 1][ALIGNED ? P : 1];  // ALIGNED: every piece of B loaded before the first sum
    if constexpr (ALIGNED) {
#pragma unroll
      for (int v = 0; v < U; ++v)
#pragma unroll
        for (int p = 0; p < P; ++p)
          braw[v][p] = p * CH < rk[v] ? *reinterpret_cast<const uint4*>(bs + (size_t)(cb + v * blockDim.x) * R + p * CH)
                                      : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
      for (int v = 0; v < U; ++v) {
        const int rj = rk[v];
        if (p * CH >= rj) continue;
        float bf[CH];
        if constexpr (ALIGNED) {
          const T* e = reinterpret_cast<const T*>(&braw[v][p]);
#pragma unroll
          for (int k = 0; k < CH; ++k) bf[k] = p * CH + k < rj ? to_float(e[k]) : 0.f;
        } else {
          one_piece<T, ALIGNED>(bs + (size_t)(cb + v * blockDim.x) * R + p * CH, min(CH, rj - p * CH), vec, bf);
        }
        const float* vp = vs + jj[v] * RW + p * CH;
#pragma unroll
        for (int i = 0; i < M; ++i) {
          if (i >= m) break;
#pragma unroll
          for (int e = 0; e < CH; ++e) d[v][i] = fmaf(bf[e], vp[i * W + e], d[v][i]);
        }
      }
    }
#pragma unroll
    for (int v = 0; v < U; ++v) {
      if (rk[v] == 0) continue;
      const int c = cb + v * blockDim.x;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if (i >= m) break;
        if (d[v][i] != 0.f) g.y[(size_t)st.row[i] * out + c] = from_float<T>(to_float(y0[v][i]) + d[v][i]);
      }
    }
  }
}

// ---- Chunks on tensor cores (16-bit types) ------------------------------------------------------
// The shrink: one_mma_rows with the chunk's m positions as the MMA's columns (lane 4 g + t reads
// position g's row of x; rows past m read nothing); the 4 warps split the share's quads, and their
// sums meet in part[i * W + j * RW + r]: at rank width 16 through an array a warp and one pass that
// adds the 4 (64 x 8 layer 42.7-43.3 -> 38.3-38.5 us warm on an H200, NOTES.md "Per-warp sums"),
// wider through shared atomics into part (zeroed first).
template <typename T, int RW, bool ALIGNED, int M>
__device__ void one_chunk_mma_shrink(const Args<T>& g, const OneChunk<M>& st, float* part, int b) {
  static_assert(M <= 8, "a chunk's positions are the 8 columns of an m16n8k16 MMA");
  __shared__ short rowmap[ONE_SLICES * RW];
  constexpr int CH = 16 / sizeof(T);
  const int in = g.in_features, n = g.n_slices, W = n * RW, m = st.m;
  const int pieces = (in + CH - 1) / CH, per_b = (pieces + ONE_CLUSTER - 1) / ONE_CLUSTER;
  const int p0 = b * per_b, p1 = min(pieces, p0 + per_b);
  int rows = 0;
  for (int j = 0; j < n; ++j) rows += st.rank[j];
  // At rank width 16 each warp's sums go to a shared array of its own and one pass adds the 4 (a
  // float add to shared memory is a compare-and-swap loop, contended by the 4 warps); wider, into
  // part with shared atomics (the 4 arrays would take 4 x M x 8 x RW floats).
  constexpr bool OWN = RW == 16;
  __shared__ float wsum[OWN ? ONE_WARPS * M * ONE_SLICES * RW : 1];
  if constexpr (!OWN)
    for (int e = threadIdx.x; e < M * W; e += blockDim.x) part[e] = 0.f;
  one_rowmap<RW>(n, st, rowmap, rows);
  __syncthreads();
  const int gq = (threadIdx.x & 31) >> 2, warp = threadIdx.x >> 5;
  const T* xr = gq < m ? g.x + (size_t)st.row[gq] * in : nullptr;
  const T* as = g.A + (size_t)st.slot * n * g.max_rank * in;
  auto out = [&](int q, int i, float v) {
    if constexpr (OWN)
      wsum[warp * M * W + i * W + rowmap[q]] = v;  // every warp writes every (position < m, row) once
    else
      atomicAdd(part + i * W + rowmap[q], v);
  };
  const int tiles = (rows + 15) / 16, qw = ((max(p1 - p0, 0) + 3) / 4 + ONE_WARPS - 1) / ONE_WARPS;
  if (tiles == 1 && qw > 4)  // `in` = 14336: 14 quads a warp, two rounds
    one_mma_rows<T, RW, ALIGNED, 1, 8, M>(g, xr, as, rowmap, rows, m, p0, p1, out);
  else if (tiles == 1)
    one_mma_rows<T, RW, ALIGNED, 1, 4, M>(g, xr, as, rowmap, rows, m, p0, p1, out);
  else
    one_mma_rows<T, RW, ALIGNED, 2, 4, M>(g, xr, as, rowmap, rows, m, p0, p1, out);
  if constexpr (OWN) {
    __syncthreads();
    // (entries of ranks past r_j are never written: one_chunk_sum selects them away)
    for (int e = threadIdx.x; e < m * W; e += blockDim.x)
      part[e] = wsum[e] + wsum[M * W + e] + wsum[2 * M * W + e] + wsum[3 * M * W + e];
  }
}

// The expand: for each tile of 16 columns of one slice (tiles start at the slice's first column),
// D[16 columns][8 positions] = B[s, columns, :r_j] . v[positions, j, :r_j]^T as MMAs of 16 ranks,
// B's rows the A operand and v the B operand (rounded to T, as the other tensor-core kernels feed
// it). Rows of the MMA are permuted so that lane 4 g + t holds columns c0 + 2g and c0 + 2g + 1
// (logical rows g and g + 8) at positions 2t and 2t + 1: its y is two 32-bit pairs. Ranks are
// permuted inside each 16: logical k {2t, 2t + 1, 2t + 8, 2t + 9} of k-step s is rank 16 s + 4 t + {0..3},
// so a lane's B is one 8-byte piece a column and k-step, and its v one float4 (packed once a slice).
// The block's tiles are walked slice by slice; warp w takes tiles w, w + 4, .... The tiles inside
// their slice with every k-step's 16 ranks below r_j, an even first column and y and B on their
// 16-byte paths (the Llama layer's every tile) run in a loop of their own (one_whole_tiles: U tiles
// a warp in flight, straight loads, no branch a lane); the rest (a slice's last partial tile, or
// every tile where B or y is off its 16-byte path) element by element, a tile a warp at a time (more
// in flight there cost the whole-tile loop registers: spills in the shrink; NOTES.md "Whole tiles in
// a loop of their own").
template <int RW>
struct OneTiles {
  // tiles a warp has in flight in one_whole_tiles: at rank width 16 the most that fit the 168 registers
  // of 3 blocks a multiprocessor without spills (7 spill 12-20 bytes, 8 40-72)
  static constexpr int U = RW <= 16 ? 6 : RW <= 64 ? 2 : 1;
};
// The expand's whole tiles [ta, tz) of one slice: every tile inside the slice, whole k-steps, an even
// first column, B and y on their 16-byte paths. Straight 8-byte loads of B and 4-byte loads of y's
// pairs, U tiles a warp in flight, and a branch-free epilogue: both columns' sums added to the pair
// and rounded together, a column whose sum is exactly zero keeping its bits by a mask, one store a
// position (none where both sums are zero). Column offsets in 32 bits (a slot's B is far below 2^31
// elements). cz: the column of tile 0 (tile i starts at cz + 16 i).
template <typename T, int RW>
__device__ __forceinline__ void one_whole_tiles(const T* bs, int R, T* const (&yr)[2], const unsigned (&bv)[RW / 16][2],
                                                int steps, int cz, int ta, int tz, int warp, int gq, int t) {
  constexpr int KS = RW / 16, U = OneTiles<RW>::U;
  const T* bl = bs + 4 * t;
  for (int tb = ta + warp; tb < tz; tb += ONE_WARPS * U) {
    int ca[U];
    unsigned bw[U][KS][2][2];  // B: [tile][k-step][column a, b][ranks 4t..4t+1, 4t+2..4t+3]
    unsigned yv[U][2];         // y: [tile][position 2t, 2t + 1] as two T (columns a, b)
#pragma unroll
    for (int u = 0; u < U; ++u) {  // the round's loads
      ca[u] = cz + 16 * (tb + ONE_WARPS * u) + 2 * gq;
      if (tb + ONE_WARPS * u >= tz) continue;
      const T* p = bl + ca[u] * R;
#pragma unroll
      for (int s = 0; s < KS; ++s) {
        if (s >= steps) break;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint2 w = *reinterpret_cast<const uint2*>(p + h * R + 16 * s);
          bw[u][s][h][0] = w.x;
          bw[u][s][h][1] = w.y;
        }
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) yv[u][c] = yr[c] ? *reinterpret_cast<const unsigned*>(yr[c] + ca[u]) : 0u;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {  // its MMAs and stores
      if (tb + ONE_WARPS * u >= tz) break;
      float d[4] = {};
#pragma unroll
      for (int s = 0; s < KS; ++s) {
        if (s >= steps) break;
        const unsigned a[4] = {bw[u][s][0][0], bw[u][s][1][0], bw[u][s][0][1], bw[u][s][1][1]};
        mma16816<T>(d, a, bv[s]);
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // position 2t + c: columns a (d[c]) and b (d[2 + c])
        const float da = d[c], db = d[2 + c];
        const float2 f = unpack2<T>(yv[u][c]);
        const unsigned w = pack2<T>(f.x + da, f.y + db), old = yv[u][c];
        const unsigned keep = (da == 0.f ? 0xffffu : 0u) | (db == 0.f ? 0xffff0000u : 0u);
        if (yr[c] && keep != 0xffffffffu) *reinterpret_cast<unsigned*>(yr[c] + ca[u]) = (w & ~keep) | (old & keep);
      }
    }
  }
}

template <typename T, int RW, bool ALIGNED, int M>
__device__ void one_chunk_mma_expand(const Args<T>& g, const OneChunk<M>& st, const float* vs, int blk, int blocks) {
  constexpr int KS = RW / 16;
  const int n = g.n_slices, W = n * RW, m = st.m, out = g.out_features, R = g.max_rank;
  const int lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
  const bool vec = ALIGNED || ((g.flags & 6) == 6);  // B and y on their 16-byte paths
  const T* bs = g.B + (size_t)st.slot * g.b_slot;
  int tiles = 0;
  for (int j = 0; j < n; ++j) tiles += st.rank[j] > 0 ? (st.off[j + 1] - st.off[j] + 15) >> 4 : 0;
  const int per = (tiles + blocks - 1) / blocks, t0 = blk * per, t1 = min(tiles, t0 + per);
  T* yr[2];  // the lane's rows of y: positions 2t and 2t + 1 (nullptr past m)
#pragma unroll
  for (int c = 0; c < 2; ++c) yr[c] = 2 * t + c < m ? g.y + (size_t)st.row[2 * t + c] * out : nullptr;
  const T zt = from_float<T>(0.f);
  int base = 0;
  for (int j = 0; j < n; ++j) {
    const int rj = st.rank[j], lo = st.off[j], hi = st.off[j + 1];
    const int nt = rj > 0 ? (hi - lo + 15) >> 4 : 0, ta = max(t0, base), tz = min(t1, base + nt);
    const int first = base;
    base += nt;
    if (ta >= tz) continue;
    const int steps = (rj + 15) >> 4;
    unsigned bv[KS][2];  // v of position gq, ranks 16 s + 4 t + {0..3}, as the MMA's B operand
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      bv[s][0] = bv[s][1] = 0u;
      if (gq < m && s < steps) {
        const float4 f = *reinterpret_cast<const float4*>(vs + gq * W + j * RW + 16 * s + 4 * t);
        bv[s][0] = pack2<T>(f.x, f.y);
        bv[s][1] = pack2<T>(f.z, f.w);
      }
    }
    // whole tiles [ta, fz) in their loop, the rest [sa, tz) element by element
    const bool fast_j = vec && !(lo & 1) && rj == 16 * steps;  // whole k-steps, pairs of y 4-byte aligned
    const int full = fast_j ? first + ((hi - lo) >> 4) : first, fz = min(tz, full), sa = max(ta, full);
    if (ta < fz) one_whole_tiles<T, RW>(bs, R, yr, bv, steps, lo - 16 * first, ta, fz, warp, gq, t);
    for (int tile = sa + warp; tile < tz; tile += ONE_WARPS) {
      const int ca = lo + 16 * (tile - first) + 2 * gq;  // the lane's columns a = ca, b = ca + 1
      unsigned bw[KS][2][2];  // B: [k-step][column a, b][ranks 4t..4t+1, 4t+2..4t+3]
      unsigned yv[2];         // y: [position 2t, 2t + 1] as two T (columns a, b)
#pragma unroll
      for (int s = 0; s < KS; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = ca + h, k = 16 * s + 4 * t, valid = c < hi ? min(max(rj - k, 0), 4) : 0;
          const T* p = bs + (size_t)c * R + k;
          T e[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) e[i] = i < valid ? p[i] : zt;
          bw[s][h][0] = *reinterpret_cast<const unsigned*>(&e[0]);
          bw[s][h][1] = *reinterpret_cast<const unsigned*>(&e[2]);
        }
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        T e[2] = {zt, zt};
        if (yr[c] && ca < hi) {
          e[0] = yr[c][ca];
          if (ca + 1 < hi) e[1] = yr[c][ca + 1];
        }
        yv[c] = *reinterpret_cast<const unsigned*>(&e[0]);
      }
      float d[4] = {};
#pragma unroll
      for (int s = 0; s < KS; ++s) {
        if (s >= steps) break;
        const unsigned a[4] = {bw[s][0][0], bw[s][1][0], bw[s][0][1], bw[s][1][1]};
        mma16816<T>(d, a, bv[s]);
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // position 2t + c: columns a (d[c]) and b (d[2 + c])
        if (!yr[c] || ca >= hi) continue;
        const float da = d[c], db = d[2 + c];  // db is 0 past the slice (B's row zero there)
        if (da == 0.f && db == 0.f) continue;
        T e[2];
        *reinterpret_cast<unsigned*>(&e[0]) = yv[c];
        if (da != 0.f) e[0] = from_float<T>(to_float(e[0]) + da);
        if (db != 0.f) e[1] = from_float<T>(to_float(e[1]) + db);
        T* p = yr[c] + ca;
        if (da != 0.f) p[0] = e[0];
        if (db != 0.f) p[1] = e[1];
      }
    }
  }
}

// A chunk's shrink and expand: 16-bit types on tensor cores, fp32 on CUDA cores (xs: the chunk's
// x staged there; unused on tensor cores).
template <typename T, int RW, bool ALIGNED, int M>
__device__ __forceinline__ void one_chunk_shrink(const Args<T>& g, const OneChunk<M>& st, float* part, T* xs, int b) {
  if constexpr (sizeof(T) == 2)
    one_chunk_mma_shrink<T, RW, ALIGNED, M>(g, st, part, b);
  else
    one_chunk_fma_shrink<T, RW, ALIGNED, M>(g, st, part, xs, b);
}
template <typename T, int RW, bool ALIGNED, int M>
__device__ __forceinline__ void one_chunk_expand(const Args<T>& g, const OneChunk<M>& st, const float* vs, int blk,
                                                 int blocks) {
  if constexpr (sizeof(T) == 2)
    one_chunk_mma_expand<T, RW, ALIGNED, M>(g, st, vs, blk, blocks);
  else
    one_chunk_fma_expand<T, RW, ALIGNED, M>(g, st, vs, blk, blocks);
}

}  // namespace lora
