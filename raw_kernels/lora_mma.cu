// Slot-grouped LoRA delta on tensor cores (mma.sync m16n8k16, fp32 accumulation):
//   shrink: v[p, j, :r] = x[t] @ A[s, j, :r].T
//   expand: y[t, cols_j] += scaling[s, j] * v[p, j, :r] @ B[s, cols_j, :r].T
// for every position p < slot_indptr[S] of token_order, t = token_order[p], s its slot (s >= 1),
// r = ranks[s, j]. Slot 0, rank-0 slices and positions past slot_indptr[S] are never touched.
//
// Positions [0, bucket) are cut into tiles of BM; a tile's rows are runs of one slot each. A block
// streams every run of its tile through one cp.async pipeline with the rows of the other runs
// zero-filled, so each row's accumulators only ever see its own slot's weights, and the weights of
// a slot are read once per tile. Rank loops stop at each slot's rank (rounded up to 16): a pool's
// rows beyond an adapter's rank cost nothing.
//   shrink task (tile, split q, slice j, rank block rb of 64): `in` split over `splits` blocks;
//     partial sums go to ws[q], and the last block of a tile adds them into ws[0] (= v) and resets
//     its counter, so every launch (and every graph replay) starts from zeroed counters.
//   expand task (tile, column block of BN): y rows prefetched to shared memory, v * scaling times
//     B on tensor cores, added in fp32 and rounded once, written back with 16-byte stores.
// lora_shrink / lora_expand: one task per block, 128 threads, a 1-D grid sized by the bucket only.
// lora_fused: both in one launch; each block takes a ticket when it starts, shrink tasks first, and
//   an expand task waits for its tile's ready count, raised only by blocks already running.
// Shapes: x [rows, in], y [rows, out], A [S, n, R, in], B [S, out, R], scaling [S, n] f32,
// ranks [S, n] i32, out_offsets [n + 1] i32 (null: one slice), token_order [bucket] i32,
// slot_indptr [S + 1] i32, ws [splits, bucket, n, rw] f32 (rw = R rounded up to 16),
// counters i32: [0] ticket, [1] done, [2, 2 + tiles) ready, then tiles * n * ceil(R / 64) split counts.
// flags: 1 = x and A take 16-byte loads, 2 = B does, 4 = y does (else element-wise paths).
#include "common.cuh"

namespace lora {

constexpr int THREADS = 128;
constexpr int MAX_SLICES = 8;

template <typename T>
struct Args {
  T* y;
  const T* x;
  const T* A;
  const T* B;
  const float* scaling;
  const int* ranks;
  const int* out_offsets;
  const int* token_order;
  const int* slot_indptr;
  float* ws;
  int* counters;
  int num_slots, n_slices, max_rank, in_features, out_features, bucket, rw, splits, k_split, col_blocks,
      flags;
  __device__ int rank_blocks() const { return (max_rank + 63) / 64; }
  __device__ size_t ws_stride() const { return (size_t)bucket * n_slices * rw; }
};

// The positions [p0, p0 + BM) of one tile: token rows, slots, and the runs of one slot >= 1.
template <int BM>
struct TileRows {
  int tok[BM];   // token row, -1 where the position addresses nothing (slot 0, padding)
  int slot[BM];  // 0 where it addresses nothing
  int run_slot[BM], run_lo[BM], run_hi[BM];
  int nrun, pend;
  int warp_count[4];
};

template <int BM>
__device__ void read_tile(TileRows<BM>& tr, int* s_indptr, const int* __restrict__ slot_indptr,
                          const int* __restrict__ token_order, int num_slots, int p0) {
  static_assert(BM <= 128, "a tile has at most 128 positions");
  const int tid = threadIdx.x;
  for (int i = tid; i <= num_slots; i += THREADS) s_indptr[i] = slot_indptr[i];
  __syncthreads();
  const int pend = s_indptr[num_slots];
  if (tid < BM) {
    const int p = p0 + tid;
    int s = 0, t = -1;
    if (p < pend) {
      s = slot_of_position(s_indptr, num_slots, p);
      if (s > 0) t = token_order[p]; else s = 0;
    }
    tr.tok[tid] = t;
    tr.slot[tid] = s;
  }
  if (tid == 0) tr.pend = pend;
  __syncthreads();
  constexpr int NW = (BM + 31) / 32;
  const int lane = tid & 31, w = tid >> 5;
  bool start = false, end = false;
  if (tid < BM) {
    const int s = tr.slot[tid];
    start = s > 0 && (tid == 0 || tr.slot[tid - 1] != s);
    end = s > 0 && (tid == BM - 1 || tr.slot[tid + 1] != s);
  }
  unsigned ms = 0;
  if (w < NW) {
    ms = __ballot_sync(0xffffffffu, start);
    if (lane == 0) tr.warp_count[w] = __popc(ms);
  }
  __syncthreads();
  if (w < NW) {
    int base = 0;
    for (int k = 0; k < w; ++k) base += tr.warp_count[k];
    if (start) {
      const int k = base + __popc(ms & ((1u << lane) - 1u));
      tr.run_slot[k] = tr.slot[tid];
      tr.run_lo[k] = tid;
    }
    if (end) tr.run_hi[base + __popc(ms & ((2u << lane) - 1u)) - 1] = tid + 1;
  }
  if (tid == 0) {
    int total = 0;
    for (int k = 0; k < NW; ++k) total += tr.warp_count[k];
    tr.nrun = total;
  }
  __syncthreads();
}

// ------------------------------------------------------------------------------------------------
// shrink
template <typename T, int BM>
struct Shrink {
  using M = typename Op<T>::type;
  static constexpr bool SPLIT = Op<T>::SPLIT;
  static constexpr int CH = 16 / sizeof(T);   // elements per 16-byte chunk
  static constexpr int KC = 128 / sizeof(T);  // in-features per pipeline stage
  static constexpr int LDK = KC + 8;          // padded shared row: conflict-free fragment loads
  static constexpr int RB = 64;               // ranks per block
  static constexpr int STAGES = 3;
  static constexpr int MT = BM / 16, WN = 4 / MT, NTW = RB / 8 / WN;
  static constexpr int STAGE = (BM + RB) * LDK;  // elements
  static constexpr int SMEM = STAGES * STAGE * (int)sizeof(T);
};

template <typename T, int BM>
__device__ void shrink_task(const Args<T>& g, char* dsmem, int* s_indptr, TileRows<BM>& tr, int u,
                            bool fused) {
  using C = Shrink<T, BM>;
  using M = typename C::M;
  __shared__ int row_r[BM];  // this row's rank inside the rank block (0..64)
  __shared__ int is_last;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int rbs = g.rank_blocks(), zdim = g.n_slices * rbs;
  const int z = u % zdim, q = (u / zdim) % g.splits, tile = u / (zdim * g.splits);
  const int j = z / rbs, rb = z % rbs, p0 = tile * BM;
  read_tile<BM>(tr, s_indptr, g.slot_indptr, g.token_order, g.num_slots, p0);
  if (p0 >= tr.pend) return;
  if (tid < BM) {
    const int s = tr.slot[tid];
    int r = 0;
    if (s > 0) r = min(max(min(g.ranks[s * g.n_slices + j], g.max_rank) - rb * C::RB, 0), C::RB);
    row_r[tid] = r;
  }
  const int any = __syncthreads_or(tid < BM && row_r[tid] > 0);
  const int in = g.in_features;
  const int kbeg = q * g.k_split, kend = min(kbeg + g.k_split, in);
  const int nk = kend > kbeg ? (kend - kbeg + C::KC - 1) / C::KC : 0;
  const int F = any ? tr.nrun * nk : 0;
  const bool vec = g.flags & 1;
  T* stages = reinterpret_cast<T*>(dsmem);
  const size_t a_slot = (size_t)g.n_slices * g.max_rank * in;

  auto load = [&](int f) {
    if (f < F) {
      const int run = f / nk, kc = f % nk;
      const int lo = tr.run_lo[run], hi = tr.run_hi[run], r = row_r[lo];
      if (r > 0) {
        T* sx = stages + (f % C::STAGES) * C::STAGE;
        T* sa = sx + BM * C::LDK;
        const int k0 = kbeg + kc * C::KC, r16 = (r + 15) & ~15;
        const T* a0 = g.A + tr.run_slot[run] * a_slot + ((size_t)j * g.max_rank + rb * C::RB) * in;
        constexpr int CPR = C::KC / C::CH;  // chunks per row
        if (vec) {
          for (int c = tid; c < BM * CPR; c += THREADS) {
            const int row = c / CPR, col = (c % CPR) * C::CH;
            const bool ok = row >= lo && row < hi && k0 + col < kend;
            const T* src = ok ? g.x + (size_t)tr.tok[row] * in + k0 + col : g.x;
            cp_async16(sx + row * C::LDK + col, src, ok ? 16 : 0);
          }
          for (int c = tid; c < r16 * CPR; c += THREADS) {
            const int row = c / CPR, col = (c % CPR) * C::CH;
            const bool ok = row < r && k0 + col < kend;
            const T* src = ok ? a0 + (size_t)row * in + k0 + col : g.A;
            cp_async16(sa + row * C::LDK + col, src, ok ? 16 : 0);
          }
        } else {
          for (int e = tid; e < BM * C::KC; e += THREADS) {
            const int row = e / C::KC, col = e % C::KC;
            const bool ok = row >= lo && row < hi && k0 + col < kend;
            sx[row * C::LDK + col] = ok ? g.x[(size_t)tr.tok[row] * in + k0 + col] : from_float<T>(0.f);
          }
          for (int e = tid; e < r16 * C::KC; e += THREADS) {
            const int row = e / C::KC, col = e % C::KC;
            const bool ok = row < r && k0 + col < kend;
            sa[row * C::LDK + col] = ok ? a0[(size_t)row * in + k0 + col] : from_float<T>(0.f);
          }
        }
      }
    }
    cp_async_commit();
  };

  float acc[C::NTW][4];
#pragma unroll
  for (int i = 0; i < C::NTW; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  const int m0 = (warp % C::MT) * 16;

#pragma unroll
  for (int st = 0; st < C::STAGES - 1; ++st) load(st);
  for (int f = 0; f < F; ++f) {
    cp_async_wait<C::STAGES - 2>();
    __syncthreads();
    load(f + C::STAGES - 1);
    const int run = f / nk, lo = tr.run_lo[run], hi = tr.run_hi[run], r = row_r[lo];
    if (r > 0 && lo < m0 + 16 && hi > m0) {
      const T* sx = stages + (f % C::STAGES) * C::STAGE;
      const T* sa = sx + BM * C::LDK;
      const int nta = ((r + 15) >> 4) * 2;  // n-tiles of 8 ranks
#pragma unroll
      for (int ks = 0; ks < C::KC / 16; ++ks) {
        Frags<M, C::SPLIT, T> fa;
        fa.load_a(sx, C::LDK, m0, ks * 16, gq, tq, 1.f);
#pragma unroll
        for (int i = 0; i < C::NTW; ++i) {
          const int nt = warp / C::MT + C::WN * i;
          if (nt < nta) {
            Frags<M, C::SPLIT, T> fb;
            fb.load_b(sa, C::LDK, nt * 8, ks * 16, gq, tq);
            mma_frags<M, C::SPLIT, C::SPLIT>(acc[i], fa, fb);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // partial (or, with one split, final) v of this split; zeros where the split's range is empty
  if (any) {
    float* dst = g.ws + (size_t)(g.splits > 1 ? q : 0) * g.ws_stride();
#pragma unroll
    for (int i = 0; i < C::NTW; ++i) {
      const int col = (warp / C::MT + C::WN * i) * 8 + 2 * tq;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + gq + 8 * h, r = row_r[row];
        if (r > 0 && col < ((r + 15) & ~15)) {
          float2 v = make_float2(acc[i][2 * h], acc[i][2 * h + 1]);
          *reinterpret_cast<float2*>(dst + ((size_t)(p0 + row) * g.n_slices + j) * g.rw + rb * C::RB + col) = v;
        }
      }
    }
  }
  bool done = true;  // whether this block completes v for (tile, j, rb)
  if (g.splits > 1) {
    const int tiles = (g.bucket + BM - 1) / BM;
    int* ctr = g.counters + 2 + tiles + tile * zdim + z;
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(ctr, 1) == g.splits - 1;
    __syncthreads();
    done = is_last;
    if (done) {
      __threadfence();
      const size_t stride = g.ws_stride();
      for (int e = tid; e < BM * (C::RB / 4); e += THREADS) {
        const int row = e / (C::RB / 4), c4 = (e % (C::RB / 4)) * 4, r = row_r[row];
        if (r > 0 && c4 < ((r + 15) & ~15)) {
          float4* p = reinterpret_cast<float4*>(g.ws + ((size_t)(p0 + row) * g.n_slices + j) * g.rw + rb * C::RB + c4);
          float4 sum = __ldcg(p);
          for (int k = 1; k < g.splits; ++k) {
            const float4 o = __ldcg(reinterpret_cast<const float4*>(reinterpret_cast<const float*>(p) + k * stride));
            sum.x += o.x; sum.y += o.y; sum.z += o.z; sum.w += o.w;
          }
          __stcg(p, sum);
        }
      }
      if (tid == 0) atomicExch(ctr, 0);
    }
  }
  if (fused && done) {
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(g.counters + 2 + tile, 1);
  }
}

// ------------------------------------------------------------------------------------------------
// expand
template <typename T, int BM, int BN>
struct Expand {
  using M = typename Op<T>::type;
  static constexpr bool SPLIT = Op<T>::SPLIT;
  static constexpr int CH = 16 / sizeof(T);
  static constexpr int KC = 32;  // ranks per pipeline stage
  static constexpr int LDB = KC + 8, LDV = KC + 8, LDY = BN + CH;
  static constexpr int STAGES = BM >= 64 ? 2 : 3;
  static constexpr int WM = BM >= 32 ? 2 : 1, WN = 4 / WM, MT = BM / WM / 16, NT = BN / WN / 8;
  static constexpr int STAGE_BYTES = BN * LDB * (int)sizeof(T) + BM * LDV * 4;
  static constexpr int SMEM = STAGES * STAGE_BYTES + BM * LDY * (int)sizeof(T);
};

// The expand's walk over (slice, run, rank chunk) of a tile and column block.
struct ExpandWalk {
  int jl, run, kc, nc;
  bool done;
};

template <typename T, int BM, int BN>
__device__ void expand_task(const Args<T>& g, char* dsmem, int* s_indptr, TileRows<BM>& tr, int u,
                            bool fused) {
  using C = Expand<T, BM, BN>;
  using M = typename C::M;
  __shared__ int s_off[MAX_SLICES + 1];
  __shared__ int pr[MAX_SLICES][BM];    // rank of (slice, run)
  __shared__ float ps[MAX_SLICES][BM];  // scaling of (slice, run)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int cb = u % g.col_blocks, tile = u / g.col_blocks, p0 = tile * BM;
  read_tile<BM>(tr, s_indptr, g.slot_indptr, g.token_order, g.num_slots, p0);
  if (p0 >= tr.pend || tr.nrun == 0) return;
  const int out = g.out_features, n = g.n_slices;
  const int c0 = cb * BN, c1 = min(c0 + BN, out);
  if (tid <= n) s_off[tid] = g.out_offsets ? g.out_offsets[tid] : (tid == 0 ? 0 : out);
  __syncthreads();
  int jlo = 0, jhi = 0;  // slices [jlo, jhi] meet columns [c0, c1)
  while (jlo + 1 < n && s_off[jlo + 1] <= c0) ++jlo;
  jhi = jlo;
  while (jhi + 1 < n && s_off[jhi + 1] < c1) ++jhi;
  const int jn = jhi - jlo + 1, nrun = tr.nrun;
  for (int e = tid; e < jn * nrun; e += THREADS) {
    const int jl = e / nrun, k = e % nrun, idx = tr.run_slot[k] * n + jlo + jl;
    pr[jl][k] = min(g.ranks[idx], g.max_rank);
    ps[jl][k] = g.scaling[idx];
  }

  T* sy = reinterpret_cast<T*>(dsmem + C::STAGES * C::STAGE_BYTES);
  const bool vec_y = g.flags & 4, vec_b = g.flags & 2;
  constexpr int YCPR = BN / C::CH;
  if (vec_y) {
    for (int c = tid; c < BM * YCPR; c += THREADS) {
      const int row = c / YCPR, col = (c % YCPR) * C::CH;
      if (tr.tok[row] >= 0 && c0 + col < c1)
        cp_async16(sy + row * C::LDY + col, g.y + (size_t)tr.tok[row] * out + c0 + col, 16);
    }
  } else {
    for (int e = tid; e < BM * BN; e += THREADS) {
      const int row = e / BN, col = e % BN;
      if (tr.tok[row] >= 0 && c0 + col < c1) sy[row * C::LDY + col] = g.y[(size_t)tr.tok[row] * out + c0 + col];
    }
  }
  cp_async_commit();
  if (fused) {
    if (tid == 0) {
      const int want = n * g.rank_blocks();
      const int* ready = g.counters + 2 + tile;
      while (load_acquire(ready) < want) __nanosleep(64);
    }
  }
  __syncthreads();

  auto chunks = [&](int jl, int run) { return (((pr[jl][run] + 15) & ~15) + C::KC - 1) / C::KC; };
  auto advance = [&](ExpandWalk& w) {
    if (++w.kc < w.nc) return;
    w.kc = 0;
    do {
      if (++w.run >= nrun) {
        w.run = 0;
        if (++w.jl >= jn) { w.done = true; return; }
      }
      w.nc = chunks(w.jl, w.run);
    } while (w.nc == 0);
  };

  auto load = [&](const ExpandWalk& w, int st) {
    if (!w.done) {
      char* base = dsmem + st * C::STAGE_BYTES;
      T* sb = reinterpret_cast<T*>(base);
      float* sv = reinterpret_cast<float*>(base + BN * C::LDB * sizeof(T));
      const int j = jlo + w.jl, s = tr.run_slot[w.run], lo = tr.run_lo[w.run], hi = tr.run_hi[w.run];
      const int r = pr[w.jl][w.run], k0 = w.kc * C::KC, kw = min(C::KC, ((r + 15) & ~15) - k0);
      const int ca = max(c0, s_off[j]), cz = min(c1, s_off[j + 1]);
      const T* bs = g.B + (size_t)s * out * g.max_rank;
      if (vec_b) {
        const int cpr = kw / C::CH;
        for (int c = tid; c < BN * cpr; c += THREADS) {
          const int row = c / cpr, k = (c % cpr) * C::CH, col = c0 + row;
          const bool ok = col >= ca && col < cz;
          const int bytes = ok ? min(max(r - (k0 + k), 0), C::CH) * (int)sizeof(T) : 0;
          cp_async16(sb + row * C::LDB + k, bytes ? bs + (size_t)col * g.max_rank + k0 + k : g.B, bytes);
        }
      } else {
        for (int e = tid; e < BN * kw; e += THREADS) {
          const int row = e / kw, k = e % kw, col = c0 + row;
          const bool ok = col >= ca && col < cz && k0 + k < r;
          sb[row * C::LDB + k] = ok ? bs[(size_t)col * g.max_rank + k0 + k] : from_float<T>(0.f);
        }
      }
      const int vpr = kw / 4;
      for (int c = tid; c < BM * vpr; c += THREADS) {
        const int row = c / vpr, k = (c % vpr) * 4;
        const bool ok = row >= lo && row < hi;
        const float* src = ok ? g.ws + ((size_t)(p0 + row) * n + j) * g.rw + k0 + k : g.ws;
        cp_async16(sv + row * C::LDV + k, src, ok ? 16 : 0);
      }
    }
    cp_async_commit();
  };

  float acc[C::MT][C::NT][4];
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
  const int wm0 = (warp / C::WN) * (BM / C::WM), wn0 = (warp % C::WN) * (BN / C::WN);

  ExpandWalk wp{0, -1, 0, 0, false}, wc{0, -1, 0, 0, false};
  advance(wp);
  advance(wc);
#pragma unroll
  for (int st = 0; st < C::STAGES - 1; ++st) {
    load(wp, st);
    if (!wp.done) advance(wp);
  }
  for (int f = 0; !wc.done; ++f) {
    cp_async_wait<C::STAGES - 2>();
    __syncthreads();
    load(wp, (f + C::STAGES - 1) % C::STAGES);
    if (!wp.done) advance(wp);
    const int lo = tr.run_lo[wc.run], hi = tr.run_hi[wc.run];
    const int r16 = (pr[wc.jl][wc.run] + 15) & ~15, ksteps = min(C::KC, r16 - wc.kc * C::KC) / 16;
    const float scale = ps[wc.jl][wc.run];
    const char* base = dsmem + (f % C::STAGES) * C::STAGE_BYTES;
    const T* sb = reinterpret_cast<const T*>(base);
    const float* sv = reinterpret_cast<const float*>(base + BN * C::LDB * sizeof(T));
#pragma unroll
    for (int ks = 0; ks < C::KC / 16; ++ks) {
      if (ks < ksteps) {
        Frags<M, C::SPLIT, float> fa[C::MT];
        bool live[C::MT];
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
          const int m0 = wm0 + mt * 16;
          live[mt] = lo < m0 + 16 && hi > m0;
          if (live[mt]) fa[mt].load_a(sv, C::LDV, m0, ks * 16, gq, tq, scale);
        }
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt) {
          Frags<M, C::SPLIT, T> fb;
          fb.load_b(sb, C::LDB, wn0 + nt * 8, ks * 16, gq, tq);
#pragma unroll
          for (int mt = 0; mt < C::MT; ++mt)
            if (live[mt]) mma_frags<M, C::SPLIT, C::SPLIT>(acc[mt][nt], fa[mt], fb);
        }
      }
    }
    advance(wc);
  }
  cp_async_wait<0>();
  __syncthreads();

  // add into the y tile (an element whose delta is exactly zero keeps its bits), then write back
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = wm0 + mt * 16 + gq + 8 * h, col = wn0 + nt * 8 + 2 * tq;
        if (tr.tok[row] >= 0) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float d = acc[mt][nt][2 * h + e];
            if (d != 0.f && c0 + col + e < c1) {
              T* py = sy + row * C::LDY + col + e;
              *py = from_float<T>(to_float(*py) + d);
            }
          }
        }
      }
  __syncthreads();
  if (vec_y) {
    for (int c = tid; c < BM * YCPR; c += THREADS) {
      const int row = c / YCPR, col = (c % YCPR) * C::CH;
      if (tr.tok[row] >= 0 && c0 + col < c1)
        *reinterpret_cast<uint4*>(g.y + (size_t)tr.tok[row] * out + c0 + col) =
            *reinterpret_cast<const uint4*>(sy + row * C::LDY + col);
    }
  } else {
    for (int e = tid; e < BM * BN; e += THREADS) {
      const int row = e / BN, col = e % BN;
      if (tr.tok[row] >= 0 && c0 + col < c1) g.y[(size_t)tr.tok[row] * out + c0 + col] = sy[row * C::LDY + col];
    }
  }
}

template <typename T, int BM, int BN>
__host__ __device__ constexpr int fused_smem() {
  return Shrink<T, BM>::SMEM > Expand<T, BM, BN>::SMEM ? Shrink<T, BM>::SMEM : Expand<T, BM, BN>::SMEM;
}

}  // namespace lora

#define LORA_PARAMS                                                                                   \
  T *y, const T *x, const T *A, const T *B, const float *scaling, const int *ranks,                   \
      const int *out_offsets, const int *token_order, const int *slot_indptr, float *ws, int *counters, \
      int num_slots, int n_slices, int max_rank, int in_features, int out_features, int bucket, int rw, \
      int splits, int k_split, int col_blocks, int flags
#define LORA_ARGS                                                                                  \
  lora::Args<T> g{y, x, A, B, scaling, ranks, out_offsets, token_order, slot_indptr, ws, counters,  \
                  num_slots, n_slices, max_rank, in_features, out_features, bucket, rw, splits,     \
                  k_split, col_blocks, flags}

// Dynamic shared memory: the kernel's stages (and y tile), then slot_indptr (S + 1 ints).
template <typename T, int BM>
__global__ void __launch_bounds__(128) lora_shrink(LORA_PARAMS) {
  extern __shared__ __align__(16) char dsmem[];
  __shared__ lora::TileRows<BM> tr;
  LORA_ARGS;
  lora::require_smem(lora::Shrink<T, BM>::SMEM + 4 * (num_slots + 1));
  lora::shrink_task<T, BM>(g, dsmem, reinterpret_cast<int*>(dsmem + lora::Shrink<T, BM>::SMEM), tr,
                           blockIdx.x, false);
}

template <typename T, int BM, int BN>
__global__ void __launch_bounds__(128) lora_expand(LORA_PARAMS) {
  extern __shared__ __align__(16) char dsmem[];
  __shared__ lora::TileRows<BM> tr;
  LORA_ARGS;
  lora::require_smem(lora::Expand<T, BM, BN>::SMEM + 4 * (num_slots + 1));
  lora::expand_task<T, BM, BN>(g, dsmem, reinterpret_cast<int*>(dsmem + lora::Expand<T, BM, BN>::SMEM), tr,
                               blockIdx.x, false);
}

template <typename T, int BM, int BN>
__global__ void __launch_bounds__(128) lora_fused(LORA_PARAMS) {
  extern __shared__ __align__(16) char dsmem[];
  __shared__ lora::TileRows<BM> tr;
  __shared__ int ticket;
  LORA_ARGS;
  lora::require_smem(lora::fused_smem<T, BM, BN>() + 4 * (num_slots + 1));
  int* s_indptr = reinterpret_cast<int*>(dsmem + lora::fused_smem<T, BM, BN>());
  const int tiles = (bucket + BM - 1) / BM;
  const int n_shrink = tiles * splits * n_slices * g.rank_blocks();
  if (threadIdx.x == 0) ticket = atomicAdd(counters, 1);
  __syncthreads();
  const int u = ticket;
  if (u < n_shrink) lora::shrink_task<T, BM>(g, dsmem, s_indptr, tr, u, true);
  else lora::expand_task<T, BM, BN>(g, dsmem, s_indptr, tr, u - n_shrink, true);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(counters + 1, 1) == (int)gridDim.x - 1) {  // every other block has finished
      for (int i = 0; i < tiles; ++i) counters[2 + i] = 0;
      counters[0] = 0;
      counters[1] = 0;
      __threadfence();
    }
  }
}
