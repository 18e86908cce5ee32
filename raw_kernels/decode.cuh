// lora_decode: the whole delta of a decode step (a few positions) in one launch, on CUDA cores.
//
// Algebra as in lora_mma.cu: v[p, j, :r] = x[t] @ A[s, j, :r].T, then
// y[t, cols_j] += scaling[s, j] * v[p, j, :r] @ B[s, cols_j, :r].T.
//
// Why CUDA cores: at a few positions per slot the arithmetic is nothing (T=64, rank 16, 4096 ->
// 14336: 40 M multiply-adds, about 1 us of the H200's fp32 units) and the time is the chain of
// dependent rounds a block walks before its bytes move. So the kernel keeps that chain short and
// uses no shared-memory pipeline and no barrier after its start: every warp is a work unit of its
// own, loads its operands straight into registers with 16-byte loads and reduces with shuffles.
//
// Work: the step's positions are cut into chunks of at most PG positions of one slot (a slot's
// range cut from its start), so the slots of a step run side by side.
//   shrink item (chunk, slice j, piece q of `in`): the warp walks its segments of 32 x 16 bytes of
//     x's row for each sub-group of SG positions against each of the slot's rank rows of A (rows
//     past the slot's rank are never read), then one butterfly of shuffles leaves each lane two
//     adjacent (position, rank) sums, added into v (float32 [bucket, n, rw]) with one 8-byte red.add.
//   expand item (chunk, run of passes of 64 columns): each lane takes two adjacent columns,
//     prefetches their B rows and the chunk's y pairs, waits until every shrink warp has signalled,
//     reads v (L2 only), adds scaling * v @ B in fp32 and rounds once (a zero delta keeps y's bits).
// Grid: `shrink_blocks` shrink blocks, then expand blocks, 128 threads; both counts fixed by the
// capture bucket and the shapes. Every block takes a ticket first: shrink roles go to the first
// tickets, so an expand warp only ever waits for shrink warps of blocks already running (no
// deadlock however few blocks are resident). Each block spreads its warps over the items the step
// has (split-K finer and longer column runs when chunks are few), from the chunk count every
// block computes from slot_indptr. The last expand warp to finish zeroes v and the counters
// ([0] ticket, [32] shrink warps done, [64] expand warps done: a 128-byte line each, so the polling
// of one does not queue the atomics of another), so every launch starts from zero.
#pragma once

namespace lora {
namespace dec {

constexpr int PG = 8;   // positions per chunk
constexpr int SG = 4;   // positions per shrink sub-group
constexpr int RB = 16;  // ranks per rank block
constexpr unsigned FULL = 0xffffffffu;
constexpr int LINE = 32;  // counters [0] ticket, [LINE] shrink warps done, [2 LINE] expand warps done

// The whole warp waits until every shrink warp has signalled: lane 0 polls (backing off), and the
// warp barrier orders the other lanes' later reads of v after its acquire.
__device__ __forceinline__ void wait_shrinks(const int* done, int shrink_warps) {
  if ((threadIdx.x & 31) == 0)
    while (load_acquire(done) < shrink_warps) __nanosleep(32);
  __syncwarp();
}

// 16 bytes of T as floats: one vector load where `vec` and the whole vector is in range,
// else element by element (the first `valid` elements; the rest read as zero).
template <typename T>
struct Vec {
  static constexpr int N = 16 / sizeof(T);
  float f[N];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int e = 0; e < N; ++e) f[e] = 0.f;
  }
  __device__ __forceinline__ void load(const T* p, int valid, bool vec) {
    if (vec && valid >= N) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
      if constexpr (sizeof(T) == 4) {
        f[0] = __uint_as_float(u.x), f[1] = __uint_as_float(u.y);
        f[2] = __uint_as_float(u.z), f[3] = __uint_as_float(u.w);
      } else {
        const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 h = unpack2<T>(w[q]);
          f[2 * q] = h.x;
          f[2 * q + 1] = h.y;
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) f[e] = e < valid ? to_float(p[e]) : 0.f;
    }
  }
};

// One chunk of the step: positions [p0, p0 + m) of slot s.
struct Chunk {
  int p0, m, s;
};

// Per lane of warp 0 after count(): chunks of the slots up to and including the lane's run of slots.
struct Scan {
  int lane_chunks[32];
  int chunks;
};

__device__ __forceinline__ int slot_len(const int* ip, int s, int positions) {
  return max(min(ip[s + 1], positions) - ip[s], 0);
}

// Counts the step's chunks (one warp; slot_indptr already staged in shared memory).
__device__ __forceinline__ void count(Scan& sc, const int* ip, int num_slots, int positions) {
  const int lane = threadIdx.x & 31;
  const int per = (num_slots - 1 + 31) / 32, s0 = 1 + lane * per, s1 = min(s0 + per, num_slots);
  int c = 0;
  for (int s = s0; s < s1; ++s) c += (slot_len(ip, s, positions) + PG - 1) / PG;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(FULL, c, o);
    if (lane >= o) c += v;
  }
  sc.lane_chunks[lane] = c;
  if (lane == 31) sc.chunks = c;
}

// Chunk k (< sc.chunks) for the whole warp: the lane whose run of slots holds it walks them.
__device__ __forceinline__ Chunk chunk_at(const Scan& sc, const int* ip, int num_slots, int positions, int k) {
  const int lane = threadIdx.x & 31;
  const int per = (num_slots - 1 + 31) / 32, s0 = 1 + lane * per, s1 = min(s0 + per, num_slots);
  const int before = lane ? sc.lane_chunks[lane - 1] : 0;
  const bool mine = k >= before && k < sc.lane_chunks[lane];
  int p0 = 0, m = 0, slot = 0;
  if (mine) {
    int kk = k - before;
    for (int s = s0; s < s1; ++s) {
      const int len = slot_len(ip, s, positions), nc = (len + PG - 1) / PG;
      if (kk < nc) {
        p0 = ip[s] + kk * PG;
        m = min(PG, len - kk * PG);
        slot = s;
        break;
      }
      kk -= nc;
    }
  }
  const int src = __ffs(__ballot_sync(FULL, mine)) - 1;
  return {__shfl_sync(FULL, p0, src), __shfl_sync(FULL, m, src), __shfl_sync(FULL, slot, src)};
}

// 64 sums per lane (index i * RB + k) reduced over the warp: lane L is left with the full sums of
// indices 2L and 2L + 1 in v[0], v[1] (at the level of lane bit O a lane keeps the half its bit selects).
template <int O>
__device__ __forceinline__ void butterfly_level(float (&v)[SG * RB], int lane) {
  const bool up = lane & O;
#pragma unroll
  for (int i = 0; i < 2 * O; ++i) {
    const float send = up ? v[i] : v[i + 2 * O];
    const float keep = up ? v[i + 2 * O] : v[i];
    v[i] = keep + __shfl_xor_sync(FULL, send, O);
  }
  if constexpr (O > 1) butterfly_level<O / 2>(v, lane);
}
__device__ __forceinline__ void butterfly64(float (&v)[SG * RB], int lane) {
  static_assert(SG * RB == 64, "the butterfly reduces 64 sums");
  butterfly_level<16>(v, lane);
}

__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// An element's bits (16-bit types in the low half) and back.
__device__ __forceinline__ unsigned bits_of(float x) { return __float_as_uint(x); }
__device__ __forceinline__ unsigned bits_of(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned bits_of(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
template <typename T> __device__ __forceinline__ T elem_of(unsigned b);
template <> __device__ __forceinline__ float elem_of<float>(unsigned b) { return __uint_as_float(b); }
template <> __device__ __forceinline__ __half elem_of<__half>(unsigned b) { return __ushort_as_half((unsigned short)b); }
template <> __device__ __forceinline__ __nv_bfloat16 elem_of<__nv_bfloat16>(unsigned b) {
  return __ushort_as_bfloat16((unsigned short)b);
}

// Shrink item: chunk ch, slice j, rank block rb, segments [q0, q1) of 32 x 16 bytes of `in`.
template <typename T>
__device__ void shrink_item(const Args<T>& g, const Chunk& ch, int j, int rb, int q0, int q1, int lane) {
  constexpr int N = Vec<T>::N, SEG = 32 * N;
  const int n = g.n_slices, in = g.in_features;
  const int tok = lane < ch.m ? g.token_order[ch.p0 + lane] : 0;
  const int r = min(g.ranks[ch.s * n + j], g.max_rank);
  if (r <= rb * RB) return;  // past the slot's rank (a rank-128 pool running a rank-16 adapter)
  const bool vec = g.flags & 1;
  const T* a0 = g.A + ((size_t)ch.s * n + j) * g.max_rank * in;
  for (int i0 = 0; i0 < ch.m; i0 += SG) {
    float acc[SG * RB];
#pragma unroll
    for (int e = 0; e < SG * RB; ++e) acc[e] = 0.f;
    for (int q = q0; q < q1; ++q) {
      const int f = q * SEG + lane * N, valid = in - f;
      Vec<T> xv[SG];
#pragma unroll
      for (int i = 0; i < SG; ++i) {
        const int t = __shfl_sync(FULL, tok, i0 + i);
        if (i0 + i < ch.m) xv[i].load(g.x + (size_t)t * in + f, valid, vec);
        else xv[i].zero();
      }
#pragma unroll
      for (int k = 0; k < RB; ++k) {
        const int kk = rb * RB + k;
        if (kk < r) {
          Vec<T> a;
          a.load(a0 + (size_t)kk * in + f, valid, vec);
#pragma unroll
          for (int i = 0; i < SG; ++i)
#pragma unroll
            for (int e = 0; e < N; ++e) acc[i * RB + k] = fmaf(xv[i].f[e], a.f[e], acc[i * RB + k]);
        }
      }
    }
    butterfly64(acc, lane);
    const int i = lane >> 3, k = 2 * (lane & 7);
    if (i0 + i < ch.m) red_add2(g.ws + ((size_t)(ch.p0 + i0 + i) * n + j) * g.rw + rb * RB + k, acc[0], acc[1]);
  }
}

// The slice holding column c (offsets staged in shared memory).
__device__ __forceinline__ int slice_of(const int* off, int n, int c) {
  int j = 0;
  while (j + 1 < n && c >= off[j + 1]) ++j;
  return j;
}

// Expand item: chunk ch, passes [c0, c1) of 64 columns. `waited`: this warp has seen every shrink
// warp's signal (it waits before its first read of v).
template <typename T>
__device__ void expand_item(const Args<T>& g, const Chunk& ch, int c0, int c1, const int* off, int shrink_warps,
                            bool& waited, int lane) {
  const int n = g.n_slices, out = g.out_features, R = g.max_rank;
  const int tok = lane < ch.m ? g.token_order[ch.p0 + lane] : 0;
  int tk[PG];  // the chunk's token rows, in every lane
#pragma unroll
  for (int i = 0; i < PG; ++i) tk[i] = __shfl_sync(FULL, tok, i);
  const bool vec_b = g.flags & 2, pair_y = g.flags & 4;  // flag 4: out % 8 == 0 and y 16-byte aligned
  for (int pass = c0; pass < c1; ++pass) {
    const int c = pass * 64 + 2 * lane;
    int jj[2], rr[2];
    float sc[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      jj[h] = slice_of(off, n, c + h);
      const bool in_range = c + h < out;
      rr[h] = in_range ? min(g.ranks[ch.s * n + jj[h]], R) : 0;
      sc[h] = in_range ? g.scaling[ch.s * n + jj[h]] : 0.f;
    }
    // y of the chunk's rows at columns c, c + 1: their bits (loaded before the wait)
    unsigned yb[PG][2];
#pragma unroll
    for (int i = 0; i < PG; ++i) {
      yb[i][0] = yb[i][1] = 0u;
      if (i < ch.m && rr[0] + rr[1] > 0) {
        const T* yp = g.y + (size_t)tk[i] * out + c;
        if (pair_y && c + 1 < out) {
          if constexpr (sizeof(T) == 4) {
            const uint2 w = *reinterpret_cast<const uint2*>(yp);
            yb[i][0] = w.x, yb[i][1] = w.y;
          } else {
            const unsigned w = *reinterpret_cast<const unsigned*>(yp);
            yb[i][0] = w & 0xffffu, yb[i][1] = w >> 16;
          }
        } else {
          if (c < out) yb[i][0] = bits_of(yp[0]);
          if (c + 1 < out) yb[i][1] = bits_of(yp[1]);
        }
      }
    }
    float acc[PG][2];
#pragma unroll
    for (int i = 0; i < PG; ++i) acc[i][0] = acc[i][1] = 0.f;
    const int rmax = max(rr[0], rr[1]);
    const int rwarp = __reduce_max_sync(FULL, rmax);  // the rank loop runs warp-uniform
    for (int rb = 0; rb * RB < rwarp; ++rb) {
      float b[2][RB];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const T* bp = g.B + ((size_t)ch.s * out + c + h) * R + rb * RB;
        const int valid = rr[h] - rb * RB;
#pragma unroll
        for (int v = 0; v < RB / Vec<T>::N; ++v) {
          Vec<T> bv;
          if (valid > v * Vec<T>::N) bv.load(bp + v * Vec<T>::N, valid - v * Vec<T>::N, vec_b);
          else bv.zero();
#pragma unroll
          for (int e = 0; e < Vec<T>::N; ++e) b[h][v * Vec<T>::N + e] = bv.f[e];
        }
      }
      if (!waited) {
        wait_shrinks(g.counters + LINE, shrink_warps);
        waited = true;
      }
#pragma unroll
      for (int i = 0; i < PG; ++i) {
        if (i < ch.m) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (rb * RB < rr[h] && (h == 0 || jj[1] != jj[0] || rb * RB >= rr[0])) {
              const float* vp = g.ws + ((size_t)(ch.p0 + i) * n + jj[h]) * g.rw + rb * RB;
#pragma unroll
              for (int k4 = 0; k4 < RB; k4 += 4) {
                const float4 w = __ldcg(reinterpret_cast<const float4*>(vp + k4));
                acc[i][h] = fmaf(w.x, b[h][k4], acc[i][h]);
                acc[i][h] = fmaf(w.y, b[h][k4 + 1], acc[i][h]);
                acc[i][h] = fmaf(w.z, b[h][k4 + 2], acc[i][h]);
                acc[i][h] = fmaf(w.w, b[h][k4 + 3], acc[i][h]);
                if (h == 0 && jj[1] == jj[0] && rb * RB < rr[1]) {  // the pair's second column, same v
                  acc[i][1] = fmaf(w.x, b[1][k4], acc[i][1]);
                  acc[i][1] = fmaf(w.y, b[1][k4 + 1], acc[i][1]);
                  acc[i][1] = fmaf(w.z, b[1][k4 + 2], acc[i][1]);
                  acc[i][1] = fmaf(w.w, b[1][k4 + 3], acc[i][1]);
                }
              }
            }
          }
        }
      }
    }
    if (rmax == 0) continue;  // lanes past `out` or on rank-0 slices (no collective below)
#pragma unroll
    for (int i = 0; i < PG; ++i) {
      if (i >= ch.m) continue;
      T* yp = g.y + (size_t)tk[i] * out + c;
      const float d0 = sc[0] * acc[i][0], d1 = sc[1] * acc[i][1];
      unsigned e0 = yb[i][0], e1 = yb[i][1];  // a zero delta keeps y's bits
      if (d0 != 0.f) e0 = bits_of(from_float<T>(to_float(elem_of<T>(e0)) + d0));
      if (d1 != 0.f) e1 = bits_of(from_float<T>(to_float(elem_of<T>(e1)) + d1));
      if (pair_y && c + 1 < out) {
        if (d0 == 0.f && d1 == 0.f) continue;
        if constexpr (sizeof(T) == 4) *reinterpret_cast<uint2*>(yp) = make_uint2(e0, e1);
        else *reinterpret_cast<unsigned*>(yp) = e0 | (e1 << 16);
      } else {
        if (c < out && d0 != 0.f) yp[0] = elem_of<T>(e0);
        if (c + 1 < out && d1 != 0.f) yp[1] = elem_of<T>(e1);
      }
    }
  }
}

}  // namespace dec

// One block of lora_decode (see the top of this file).
template <typename T>
__device__ void decode_block(const Args<T>& g, int* s_indptr, int shrink_blocks, int blocks) {
  using namespace dec;
  __shared__ int ticket;
  __shared__ int s_off[MAX_SLICES + 1];
  __shared__ Scan sc;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n = g.n_slices;
  if (tid == 0) ticket = atomicAdd(g.counters, 1);
  for (int i = tid; i <= g.num_slots; i += THREADS) s_indptr[i] = g.slot_indptr[i];
  if (tid <= n) s_off[tid] = g.out_offsets ? g.out_offsets[tid] : (tid == 0 ? 0 : g.out_features);
  __syncthreads();
  if (warp == 0) count(sc, s_indptr, g.num_slots, g.positions);
  __syncthreads();
  const int chunks = sc.chunks, u = ticket;
  const int shrink_warps = shrink_blocks * (THREADS / 32);
  const int expand_warps = (blocks - shrink_blocks) * (THREADS / 32);
  if (u < shrink_blocks) {
    // items (chunk, slice, rank block, piece of `in`), the rank block slowest: blocks past every
    // adapter's rank come last and stop at once
    const int nseg = (g.in_features + 32 * Vec<T>::N - 1) / (32 * Vec<T>::N);
    const int rbs = (g.max_rank + RB - 1) / RB;
    const int base = max(chunks * n, 1);
    const int want = max(1, min(nseg, shrink_warps / base));
    const int per = (nseg + want - 1) / want, splits = (nseg + per - 1) / per;
    const int items = chunks * n * splits * rbs;
    for (int it = u * (THREADS / 32) + warp; it < items; it += shrink_warps) {
      const int q = it % splits, j = (it / splits) % n, k = (it / (splits * n)) % max(chunks, 1);
      const int rb = it / (splits * n * max(chunks, 1));
      const Chunk ch = chunk_at(sc, s_indptr, g.num_slots, g.positions, k);
      shrink_item<T>(g, ch, j, rb, q * per, min(nseg, (q + 1) * per), lane);
    }
    __threadfence();
    __syncwarp();
    if (lane == 0) atomicAdd(g.counters + LINE, 1);
    return;
  }
  const int passes = (g.out_features + 63) / 64;
  const int want = max(1, min(passes, expand_warps / max(chunks, 1)));
  const int per = (passes + want - 1) / want, groups = (passes + per - 1) / per;
  const int items = chunks * groups;
  bool waited = false;
  for (int it = (u - shrink_blocks) * (THREADS / 32) + warp; it < items; it += expand_warps) {
    const int k = it / groups, q = it % groups;
    const Chunk ch = chunk_at(sc, s_indptr, g.num_slots, g.positions, k);
    expand_item<T>(g, ch, q * per, min(passes, (q + 1) * per), s_off, shrink_warps, waited, lane);
  }
  __syncwarp();  // every lane's reads of v are done before the warp counts itself out
  int last = 0;
  if (lane == 0) last = atomicAdd(g.counters + 2 * LINE, 1) == expand_warps - 1;
  if (__shfl_sync(FULL, last, 0)) {  // every expand warp has read v: zero it and the counters
    wait_shrinks(g.counters + LINE, shrink_warps);
    const int pend = min(s_indptr[g.num_slots], g.positions);
    float4* v4 = reinterpret_cast<float4*>(g.ws);
    const int n4 = pend * n * g.rw / 4;
    for (int e = lane; e < n4; e += 32) v4[e] = make_float4(0.f, 0.f, 0.f, 0.f);
    __threadfence();
    if (lane == 0) {
      g.counters[0] = 0;
      g.counters[LINE] = 0;
      g.counters[2 * LINE] = 0;
      __threadfence();
    }
  }
}

}  // namespace lora
