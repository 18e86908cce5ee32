// Two changes to lora_one's chain of dependent rounds (one.cuh), for raw_kernels/dev/one_variants.py,
// which puts this file after one.cuh in a dev module of its own (not in the wheel; bf16 ALIGNED):
// - one_setup_next (one_setup's work) loads the ranks and scalings of each thread's first slot beside slot_indptr, so a
//   slot below 1 + blockDim.x needs no second round of loads;
// - one_prefetch loads each thread's first column's B row and y before the shrink, and
//   one_expand_next uses them after the cluster's sum (the other columns as one_expand does).
#pragma once

namespace lora {

template <typename T>
__device__ bool one_setup_next(const Args<T>& g, OneStep& st) {
  const int tid = threadIdx.x, S = g.num_slots, n = g.n_slices;
  const int s1 = 1 + tid;  // this thread's first slot: its ranks and scalings come with slot_indptr
  int rk[ONE_SLICES];
  float sc[ONE_SLICES];
#pragma unroll
  for (int j = 0; j < ONE_SLICES; ++j) {
    const bool on = s1 < S && j < n;
    rk[j] = on ? g.ranks[s1 * n + j] : 0;
    sc[j] = on ? g.scaling[s1 * n + j] : 0.f;
  }
  int found = 0;
  for (int s = s1; s < S; s += blockDim.x)  // slot 0 is no adapter
    if (g.slot_indptr[s + 1] > g.slot_indptr[s]) found = s;
  const int off = tid <= n ? (n > 1 ? g.out_offsets[tid] : (tid == 0 ? 0 : g.out_features)) : 0;
  const int row = tid == 0 ? g.token_order[0] : 0;
  if (tid == 0) st.slot = 0;
  __syncthreads();
  if (found) st.slot = found;  // one slot holds the step's one position
  if (found && found == s1) {
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
    r = min(max(second ? g.ranks[s * n + tid] : st.rank[tid], 0), g.max_rank);
    scale = second ? g.scaling[s * n + tid] : st.scale[tid];
  }
  __syncthreads();
  if (tid < ONE_SLICES) {
    st.rank[tid] = r;
    st.scale[tid] = scale;
  }
  __syncthreads();
  int rows = 0;
  for (int j = 0; j < n; ++j) rows += st.rank[j];
  return rows > 0;
}

// Each thread's first column of the block: its B row's pieces below the slice's rank and its y.
template <typename T, int RW>
struct OneCol {
  uint4 b[RW * sizeof(T) / 16];
  T y;
};
template <typename T, int RW, bool ALIGNED>
__device__ __forceinline__ void one_prefetch(const Args<T>& g, const OneStep& st, int blk, int blocks,
                                             OneCol<T, RW>& pc) {
  constexpr int CH = 16 / sizeof(T);
  const int out = g.out_features, n = g.n_slices, R = g.max_rank;
  const int per = (out + blocks - 1) / blocks, c = blk * per + threadIdx.x, c1 = min(out, blk * per + per);
  if (!ALIGNED || threadIdx.x >= per || c >= c1) return;
  int j = 0;
  while (j + 1 < n && c >= st.off[j + 1]) ++j;
  const int rj = st.rank[j];
  const T* br = g.B + (size_t)st.slot * g.b_slot + (size_t)c * R;
#pragma unroll
  for (int p = 0; p < RW / CH; ++p)
    pc.b[p] = p * CH < rj ? *reinterpret_cast<const uint4*>(br + p * CH) : make_uint4(0u, 0u, 0u, 0u);
  pc.y = g.y[(size_t)st.row * out + c];
}
template <typename T, int RW, bool ALIGNED>
__device__ void one_expand_next(const Args<T>& g, const OneStep& st, const float* vs, int blk, int blocks,
                                const OneCol<T, RW>& pc) {
  constexpr int CH = 16 / sizeof(T);
  const int out = g.out_features, n = g.n_slices, R = g.max_rank;
  const int per = (out + blocks - 1) / blocks, c0 = blk * per, c1 = min(out, c0 + per);
  const bool vec = ALIGNED || (g.flags & 2);
  const T* bs = g.B + (size_t)st.slot * g.b_slot;
  T* yr = g.y + (size_t)st.row * out;
  for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
    int j = 0;
    while (j + 1 < n && c >= st.off[j + 1]) ++j;
    const int rj = st.rank[j];
    if (rj == 0) continue;
    const bool first = ALIGNED && c == c0 + int(threadIdx.x);
    const T* br = bs + (size_t)c * R;
    const float* vj = vs + j * RW;
    float d = 0.f;
#pragma unroll
    for (int p = 0; p < RW / CH; ++p) {
      if (p * CH >= rj) break;
      float bf[CH];
      if (first) {
        const T* e = reinterpret_cast<const T*>(&pc.b[p]);
#pragma unroll
        for (int i = 0; i < CH; ++i) bf[i] = p * CH + i < rj ? to_float(e[i]) : 0.f;
      } else {
        one_piece<T, ALIGNED>(br + p * CH, min(CH, rj - p * CH), vec, bf);
      }
#pragma unroll
      for (int i = 0; i < CH; ++i) d = fmaf(bf[i], vj[p * CH + i], d);
    }
    const T y0 = first ? pc.y : yr[c];
    if (d != 0.f) yr[c] = from_float<T>(to_float(y0) + d);
  }
}

}  // namespace lora
