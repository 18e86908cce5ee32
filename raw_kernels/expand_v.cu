// lora_expand_v: the expand of a small step's delta whose v the base GEMM has already written.
//
// The attachment extends a target's first linear by the pool's A rows of every slot
// ([out_0 + S*n*R, in]), so the model's own GEMM writes y_0 and, beside it in the same rows,
// v[t, (s*n + j)*R + r] = x[t] . A[s, j, r] for every slot s (lora_cupy/integrations/attach.py).
// What is left of the delta is, for each position p of slot s's range of token_order (s >= 1),
// t = token_order[p], and each slice j with r_sj = ranks[s, j] > 0:
//   y_j[t, c] += scaling[s, j] * sum_{r < r_sj} v[t, (s*n + j)*R + r] * B[s, boff_j + c, r]
// (B of one slot [out_total, R], R contiguous, or rank-blocked [ceil(R / 16), out_total, 16]: column c,
// rank r at c * b_ld + (r / 16) * b_blk + r % 16, as lora_mma.cu's Args::b_at; slots b_slot elements apart).
//
// CUDA cores, no shared-memory pipeline, no workspace, no counters: a block takes one chunk (at
// most TG positions of one slot, chunks numbered in slot order) x one slice x 4 * blockDim.x
// columns, each thread 4 adjacent columns (8-byte rows of y; B and v in 16-byte pieces: every row
// pointer and stride of y a multiple of 4 elements and of v of 8, R a multiple of 8, which the
// host checks). Rounds of dependent loads: the chunk (a scan of slot_indptr by one warp, 64 slots
// a round), then the chunk's token rows, its rank and B's first rank block, then y and the chunk's
// v rows (into shared memory, masked past the rank), then the stores. 2-byte element types only (bfloat16,
// float16).
//
// Launched with programmatic dependent launch after the GEMM that wrote y and v (the host's
// after_gemm; lora_cupy/backends/launch_ex.py), everything up to B's first rank block runs while
// that GEMM finishes: the block waits for it (lora::wait_prior_grid) just before it reads y and v,
// the only arrays the GEMM writes. Launched the usual way, the wait returns at once.
#include "common.cuh"

namespace lora_v {

// 16-byte (8 elements) and 8-byte (4 elements) pieces of 2-byte elements as floats and back, word
// by word through common.cuh's unpack2 / pack2
template <typename T> __device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = lora::unpack2<T>(w[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}
template <typename T> __device__ __forceinline__ void unpack4(const uint2& u, float* f) {
  const float2 a = lora::unpack2<T>(u.x), b = lora::unpack2<T>(u.y);
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}
template <typename T> __device__ __forceinline__ uint2 pack4(const float* f) {
  return make_uint2(lora::pack2<T>(f[0], f[1]), lora::pack2<T>(f[2], f[3]));
}

}  // namespace lora_v

// Up to 3 slices (y_j, its row stride ldy_j, its columns out_j, its first row boff_j of B); a
// slice with no columns (out_j = 0) is skipped. compact = 0: v holds every slot's block, slot s at
// columns (s*n + j)*R. compact = kb > 0 (a step of few rows, whose GEMM appended only the A rows
// lora_gather_a placed for it): v points at the block of the step's first slot with positions,
// and the k-th such slot (k = 0, 1, ..., kb - 1) sits k blocks of n*R columns to the left of it;
// a slot past the kb-th adds nothing (the host passes kb >= the step's rows, so there is none). Grid: x = column blocks of 4 * blockDim.x of the
// widest slice, y = at least the step's chunk count (blocks past it return), z = slices.
template <typename T, int R, int TG>
__global__ void __launch_bounds__(128) lora_expand_v(
    T* y0, T* y1, T* y2, long long ldy0, long long ldy1, long long ldy2, int out0, int out1, int out2,
    int boff0, int boff1, int boff2, const T* __restrict__ v, long long ldv, const T* __restrict__ B,
    long long b_slot, int b_ld, long long b_blk, const float* __restrict__ scaling, const int* __restrict__ ranks,
    const int* __restrict__ token_order, const int* __restrict__ slot_indptr, int num_slots, int n,
    int compact) {
  static_assert(R % 8 == 0, "the rank width comes in 16-byte pieces");
  constexpr int KB = R < 16 ? R : 16;  // ranks a step of the rank loop
  constexpr int P = KB / 8;            // 16-byte pieces of one row a step
  constexpr int COLS = 4;              // adjacent columns a thread (8-byte rows of y)
  __shared__ int chunk[4];             // slot, first position, positions, v's block of the slot
  __shared__ float vs[TG][R];          // the chunk's v rows
  const int j = blockIdx.z;
  T* const y = j == 0 ? y0 : (j == 1 ? y1 : y2);
  const long long ldy = j == 0 ? ldy0 : (j == 1 ? ldy1 : ldy2);
  const int out = j == 0 ? out0 : (j == 1 ? out1 : out2);
  const int boff = j == 0 ? boff0 : (j == 1 ? boff1 : boff2);
  if (static_cast<int>(blockIdx.x * blockDim.x) * COLS >= out) return;  // block-uniform: past this slice's columns
  if (threadIdx.x < 32) {  // warp 0: chunk blockIdx.y, slots 1.. in order, each cut every TG positions
    const int lane = threadIdx.x;  // a pass covers 64 slots, two a lane, in one round of loads
    int want = blockIdx.y;
    bool found = false;
    for (int base = 1; base < num_slots && !found; base += 64) {
      const int sa = base + 2 * lane;
      int p0 = 0, p1 = 0, p2 = 0;  // slot_indptr at sa, sa + 1, sa + 2 (clamped to the table)
      if (sa < num_slots) {
        p0 = slot_indptr[sa];
        p1 = slot_indptr[sa + 1];
        p2 = sa + 1 < num_slots ? slot_indptr[sa + 2] : p1;
      }
      const int ca = (p1 - p0 + TG - 1) / TG, cb = (p2 - p1 + TG - 1) / TG;
      const int cnt = ca + cb;
      int incl = cnt;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
      }
      const int excl = incl - cnt;
      const unsigned hit = __ballot_sync(0xffffffffu, cnt > 0 && want >= excl && want < incl);
      if (hit) {
        found = true;
        if (lane == __ffs(hit) - 1) {
          const int k = want - excl;  // the lane's k-th chunk: slot sa's, then slot sa + 1's
          const bool a = k < ca;
          const int first = a ? p0 + k * TG : p1 + (k - ca) * TG;
          chunk[0] = a ? sa : sa + 1;
          chunk[1] = first;
          chunk[2] = min(TG, (a ? p1 : p2) - first);
        }
      }
      want -= __shfl_sync(0xffffffffu, incl, 31);
    }
    if (!found && lane == 0) chunk[0] = -1;
    __syncwarp();
    if (found) {  // v's block of the chunk's slot: s, or (compact) minus the slot's ordinal
      const int cs = chunk[0];
      const int vb = compact ? -lora::active_slots_before(slot_indptr, cs, lane) : cs;
      if (lane == 0) {
        chunk[3] = vb;
        if (-vb >= compact && compact) chunk[0] = -1;  // past the kb blocks v holds: nothing
      }
    }
  }
  __syncthreads();
  const int s = chunk[0];
  if (s < 0) return;  // block-uniform: no chunk of this step
  const int p0 = chunk[1], np = chunk[2], vblock = chunk[3];
  const int rank = ranks[s * n + j];
  const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * COLS;
  const bool mine = c0 < out && rank > 0;  // the thread has columns to add to
  // before the barrier, a thread's own loads (token rows, B's first rank block, then y) go out
  // with the block's load of v
  int tok[TG];
#pragma unroll
  for (int i = 0; i < TG; ++i) tok[i] = i < np ? token_order[p0 + i] : 0;
  const T* bs = B + s * b_slot + static_cast<long long>(boff + (mine ? c0 : 0)) * b_ld;
  uint2 yv[TG];
  uint4 b[COLS][P];
  if (mine) {
#pragma unroll
    for (int c = 0; c < COLS; ++c)
#pragma unroll
      for (int q = 0; q < P; ++q) b[c][q] = *reinterpret_cast<const uint4*>(bs + c * b_ld + 8 * q);
  }
  lora::wait_prior_grid();  // y and v below: the GEMM's (every thread reads v)
  if (mine) {
#pragma unroll
    for (int i = 0; i < TG; ++i)
      if (i < np) yv[i] = *reinterpret_cast<const uint2*>(y + tok[i] * ldy + c0);
  }
  // the chunk's v rows, rank-masked, into shared memory as float (every thread reads all of them)
  for (int e = threadIdx.x; e < TG * (R / 8); e += blockDim.x) {
    const int i = e / (R / 8), q = e % (R / 8);
    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (i < np && 8 * q < rank) {
      const uint4 u = *reinterpret_cast<const uint4*>(v + token_order[p0 + i] * ldv +
                                                      static_cast<long long>(vblock * n + j) * R + 8 * q);
      lora_v::unpack8<T>(u, f);
#pragma unroll
      for (int r = 0; r < 8; ++r) f[r] = 8 * q + r < rank ? f[r] : 0.f;  // v past the rank is never read
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) vs[i][8 * q + r] = f[r];
  }
  __syncthreads();
  if (!mine) return;
  const float sc = scaling[s * n + j];
  float acc[TG][COLS];
#pragma unroll
  for (int i = 0; i < TG; ++i)
#pragma unroll
    for (int c = 0; c < COLS; ++c) acc[i][c] = 0.f;
#pragma unroll 1
  for (int k0 = 0; k0 < rank; k0 += KB) {  // rank blocks past the adapter's rank are never read
    if (k0 > 0) {
#pragma unroll
      for (int c = 0; c < COLS; ++c)
#pragma unroll
        for (int q = 0; q < P; ++q)
          b[c][q] = *reinterpret_cast<const uint4*>(bs + c * b_ld + (k0 >> 4) * b_blk + (k0 & 15) + 8 * q);
    }
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      float bf[KB];
#pragma unroll
      for (int q = 0; q < P; ++q) lora_v::unpack8<T>(b[c][q], bf + 8 * q);
#pragma unroll
      for (int r = 0; r < KB; ++r) bf[r] = k0 + r < rank ? bf[r] : 0.f;  // B past the rank is never used
#pragma unroll
      for (int i = 0; i < TG; ++i) {
        float a = acc[i][c];
#pragma unroll
        for (int r = 0; r < KB; ++r) a = fmaf(vs[i][k0 + r], bf[r], a);
        acc[i][c] = a;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < TG; ++i) {
    if (i >= np) break;
    float yf[4];
    lora_v::unpack4<T>(yv[i], yf);
#pragma unroll
    for (int c = 0; c < COLS; ++c) yf[c] = fmaf(sc, acc[i][c], yf[c]);
    *reinterpret_cast<uint2*>(y + tok[i] * ldy + c0) = lora_v::pack4<T>(yf);
  }
}

// lora_gather_a: the A rows of a step's slots with positions, gathered where a small step's GEMM
// reads them. For each entry e of the table (src, dst, bytes: three 64-bit words) and each k <
// gridDim.y, the k-th slot s >= 1 in slot order whose range of token_order is not empty (none:
// nothing) copies its block of bytes (its A [n, R, in], contiguous) from src + s * bytes to
// dst - k * bytes: the first such slot's block ends where the base weight starts, the next one
// before it, so a GEMM of x with rows [dst - kb * bytes, dst + weight) writes every slot's v the
// step needs beside y (lora_expand_v with compact = kb reads them). bytes: a multiple of 16.
// Grid: x = blocks a slot's block is split over, y = the slots a step can have, z = entries.
__global__ void __launch_bounds__(256) lora_gather_a(const long long* __restrict__ table,
                                                     const int* __restrict__ slot_indptr, int num_slots) {
  __shared__ int slot;
  const long long* e = table + 3 * blockIdx.z;
  if (threadIdx.x < 32) {
    const int s = lora::nth_active_slot(slot_indptr, num_slots, blockIdx.y, threadIdx.x);
    if (threadIdx.x == 0) slot = s;
  }
  __syncthreads();
  const int s = slot;
  if (s < 0) return;
  const long long bytes = e[2], pieces = bytes / 16;
  const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(e[0]) + s * bytes);
  uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<char*>(e[1]) - static_cast<long long>(blockIdx.y) * bytes);
  for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < pieces; i += static_cast<long long>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}
