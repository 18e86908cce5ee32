// The v5 ("pipe") shrink: v[p, j, rank block] (+)= x[t] @ A[s, j, ranks].T, with each warp running
// its own cp.async pipeline over its 16 rows of x. Included by lora_mma.cu after expand_pipe.cuh
// (it uses Pipe and the tile helpers).
//
// A block takes one tile of BM positions, one split of `in` (k_split features), one slice and one
// block of RB = 64 ranks, as the v3 shrink. Its warps split the tile into m-tiles of 16 rows; when
// BM < 64 the warps of one m-tile take the split's chunks in turn. After the block has read the
// tile's runs and their ranks, every warp works on its own, with no block barrier:
//   - a warp walks (run, chunk) over the runs meeting its rows; a chunk is one 128-byte line of each
//     row of the run (the other rows and features past the split are zero-filled), DEPTH - 1
//     chunks in flight in the warp's ring of shared-memory stages;
//   - x fragments come from the stage and A fragments (8 ranks x 4 features a lane) straight from
//     global memory (L1 / L2), features permuted inside each k-step the same way for both
//     (common.cuh); those of the first 16 ranks are loaded one step ahead; n-tiles past the
//     run's rank are skipped and its A rows are never read;
//   - when a warp leaves a run, lanes pair up so each holds 4 consecutive ranks of a row and add
//     them into v with one 16-byte red.add (a plain store when one warp alone writes each element).
#pragma once

namespace lora {

template <typename T, int BM>
__device__ void shrink_pipe_task(const Args<T>& g, char* dsmem, int* s_indptr, TileRows<BM>& tr, int u) {
  using C = Pipe<T>;
  using M = typename Op<T>::type;
  constexpr bool SPLIT = Op<T>::SPLIT;
  constexpr int RB = 64, NTW = RB / 8;    // ranks of a block; n-tiles of a warp
  constexpr int MT = BM / 16, WK = 4 / MT;  // m-tiles; warps that share an m-tile's chunks
  constexpr int D = C::DEPTH;
  __shared__ int run_r[BM];  // each run's rank inside this rank block (0..RB)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int R = g.max_rank, n = g.n_slices, in = g.in_features;
  const ShrinkTask task = shrink_task_of<T, BM>(g, u, g.tiles(BM), g.splits);
  const int q = task.q, j = task.j, rb = task.rb, tile = task.tile, p0 = tile * BM;
  read_tile<BM>(tr, s_indptr, g.slot_indptr, g.token_order, g.num_slots, g.positions, p0);
  if (p0 >= tr.pend) return;
  for (int k = tid; k < tr.nrun; k += THREADS)
    run_r[k] = min(max(min(g.ranks[tr.run_slot[k] * n + j], R) - rb * RB, 0), RB);
  __syncthreads();

  const int m0 = (warp % MT) * 16, cl = warp / MT;
  int ka, kb;  // the runs meeting this warp's rows
  runs_meeting<BM>(tr, m0, ka, kb);
  const int kbeg = q * g.k_split, kend = min(kbeg + g.k_split, in);
  const int nk = kend > kbeg ? (kend - kbeg + C::COLS - 1) / C::COLS : 0;  // chunks of the split
  const int per = nk > cl ? (nk - cl + WK - 1) / WK : 0;                   // of them this warp's
  const int F = kb >= ka ? (kb - ka + 1) * per : 0;                        // steps (run, chunk)
  const bool vec = g.flags & 1;
  const size_t a_slot = (size_t)n * R * in;
  T* ring = reinterpret_cast<T*>(dsmem) + warp * D * C::STAGE;
  const int cc = (lane & 7) * C::CH;
  int crow[4];  // tile rows of this lane's copies
#pragma unroll
  for (int i = 0; i < 4; ++i) crow[i] = m0 + pipe_row(lane, i);

  // x of step f: run ka + f / per, chunk cl + WK (f % per), into stage f % D; rows outside the
  // run and features past the split are zero
  auto issue = [&](int f) {
    if (f < F) {
      const int k = ka + f / per, k0 = kbeg + (cl + WK * (f % per)) * C::COLS;
      const int lo = tr.run_lo[k], hi = tr.run_hi[k];
      T* st = ring + (f % D) * C::STAGE;
      if (run_r[k] > 0) {
        if (vec) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = crow[i];
            const bool ok = row >= lo && row < hi && k0 + cc < kend;
            cp_async16(st + pipe_row(lane, i) * C::LD + cc, ok ? g.x + (size_t)tr.tok[row] * in + k0 + cc : g.x,
                       ok ? 16 : 0);
          }
        } else {
          for (int e = lane; e < 16 * C::COLS; e += 32) {
            const int row = m0 + e / C::COLS, col = e % C::COLS;
            const bool ok = row >= lo && row < hi && k0 + col < kend;
            st[(e / C::COLS) * C::LD + col] = ok ? g.x[(size_t)tr.tok[row] * in + k0 + col] : from_float<T>(0.f);
          }
        }
      }
    }
    cp_async_commit();
  };

  float acc[NTW][4];
#pragma unroll
  for (int i = 0; i < NTW; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  // A fragments of the first 16 ranks of step f (every k-step), loaded one step ahead so the
  // loop waits on memory only for ranks past 16
  constexpr int KS = C::COLS / 16;
  Frags<M, SPLIT, T> anext[KS][2];
  auto load_a0 = [&](int f) {
    if (f >= F) return;
    const int k = ka + f / per, r = run_r[k];
    if (r == 0) return;
    const int k0 = kbeg + (cl + WK * (f % per)) * C::COLS;
    const T* ab = g.A + tr.run_slot[k] * a_slot + ((size_t)j * R + rb * RB) * in;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int rank = nt * 8 + gq;
        load_frag_col<T, M, SPLIT>(anext[ks][nt], ab, in, rank, rank < r, k0 + ks * 16 + 4 * tq, kend, vec);
      }
  };
  load_a0(0);

#pragma unroll
  for (int f = 0; f < D - 1; ++f) issue(f);
  for (int f = 0; f < F; ++f) {
    cp_async_wait<D - 2>();
    __syncwarp();
    issue(f + D - 1);  // into the stage step f - 1 read: every lane is past it (barrier above)
    const int k = ka + f / per, r = run_r[k];
    Frags<M, SPLIT, T> acur[KS][2];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      acur[ks][0] = anext[ks][0];
      acur[ks][1] = anext[ks][1];
    }
    if (LORA_PIPE_PROBE == 0) load_a0(f + 1);
    if (LORA_PIPE_PROBE == 0 && r > 0) {
      const int k0 = kbeg + (cl + WK * (f % per)) * C::COLS;
      const T* st = ring + (f % D) * C::STAGE;
      const T* ab = g.A + tr.run_slot[k] * a_slot + ((size_t)j * R + rb * RB) * in;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        Frags<M, SPLIT, T> fa;
        const T* p = st + gq * C::LD + ks * 16 + 4 * tq;
        if constexpr (sizeof(T) == 4) {
          const float4 f0 = *reinterpret_cast<const float4*>(p);
          const float4 f1 = *reinterpret_cast<const float4*>(p + 8 * C::LD);
          pack_scaled<M, SPLIT>(f0.x, f0.y, 1.f, fa.a[0], fa.al[0]);
          pack_scaled<M, SPLIT>(f1.x, f1.y, 1.f, fa.a[1], fa.al[1]);
          pack_scaled<M, SPLIT>(f0.z, f0.w, 1.f, fa.a[2], fa.al[2]);
          pack_scaled<M, SPLIT>(f1.z, f1.w, 1.f, fa.a[3], fa.al[3]);
        } else {
          const uint2 w0 = *reinterpret_cast<const uint2*>(p);
          const uint2 w1 = *reinterpret_cast<const uint2*>(p + 8 * C::LD);
          fa.a[0] = w0.x;
          fa.a[1] = w1.x;
          fa.a[2] = w0.y;
          fa.a[3] = w1.y;
        }
        mma_frags<M, SPLIT, SPLIT>(acc[0], fa, acur[ks][0]);
        if (r > 8) mma_frags<M, SPLIT, SPLIT>(acc[1], fa, acur[ks][1]);
#pragma unroll
        for (int nt = 2; nt < NTW; ++nt) {
          if (nt * 8 < r) {
            const int rank = nt * 8 + gq;
            Frags<M, SPLIT, T> fb;
            load_frag_col<T, M, SPLIT>(fb, ab, in, rank, rank < r, k0 + ks * 16 + 4 * tq, kend, vec);
            mma_frags<M, SPLIT, SPLIT>(acc[nt], fa, fb);
          }
        }
      }
    }
    // leaving run k: its rows' share of v, lanes tq and tq ^ 1 swapping halves so each holds four
    // consecutive ranks of one row; ranks in [r, r16) carry zeros
    if (f % per == per - 1) {
      const int lo = tr.run_lo[k], hi = tr.run_hi[k], r16 = (r + 15) & ~15;
      const bool odd = tq & 1;
      const int row = m0 + gq + (odd ? 8 : 0);
#pragma unroll
      for (int i = 0; i < NTW; ++i) {
        const float s0 = odd ? acc[i][0] : acc[i][2], s1 = odd ? acc[i][1] : acc[i][3];
        const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
        const float4 quad = odd ? make_float4(r0, r1, acc[i][2], acc[i][3]) : make_float4(acc[i][0], acc[i][1], r0, r1);
        const int col = i * 8 + 2 * (tq & ~1);
        if (row >= lo && row < hi && col < r16) {
          float* v = g.ws + ((size_t)(p0 + row) * n + j) * g.rw + rb * RB + col;
          if (g.splits == 1 && WK == 1) *reinterpret_cast<float4*>(v) = quad;
          else red_add4(v, quad);
        }
        acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
      }
    }
  }
  cp_async_wait<0>();
}

}  // namespace lora
