// The v4 ("stream") shrink: v[p, j, rank block] (+)= x[t] @ A[s, j, ranks].T, with each warp streaming
// its rows of x and the slot's A from global memory into registers. Included by lora_mma.cu (it
// uses Args, TileRows and read_tile from there).
//
// A block takes one tile of BM positions, one split of `in` (k_split features), one slice and one
// block of RB ranks. Its warps split the tile into m-tiles of 16 rows; when BM < 64, the warps of
// one m-tile take the split's 32-feature chunks in turn. After the block has read the tile's runs
// and their ranks, every warp works on its own: no shared memory and no barrier.
//   - x and A of the next D - 1 chunks are in flight in registers (16-byte loads): features are
//     permuted inside a chunk so that each lane's x fragment of a row and A fragment of a rank are
//     8 consecutive features, for both k-steps of the chunk;
//   - a warp walks (run, chunk) over the runs meeting its rows; rows outside the run are zero, A
//     rows from the run's rank on are zero and never read, n-tiles past the rank are skipped;
//   - at the end lanes pair up so each holds 4 consecutive ranks of a row, and add them into v with
//     one 16-byte red.add (a plain store when one warp alone writes each element of v).
#pragma once

namespace lora {

template <typename T>
struct StreamShrink {
  using M = typename Op<T>::type;
  static constexpr bool SPLIT = Op<T>::SPLIT;
  static constexpr int RB = sizeof(T) == 4 ? 16 : 32;  // ranks of one block
  static constexpr int NTW = RB / 8;                   // n-tiles of a warp
  static constexpr int KW = 32;                        // features of one chunk (two k-steps)
  static constexpr int W = 4 * (int)sizeof(T) / 2;     // 32-bit words of 8 elements
  static constexpr int D = sizeof(T) == 4 ? 2 : 3;     // chunks held in registers
};

// 8 elements of a row from k0 on (zero where k >= kend or when !live) as 32-bit words.
template <typename T>
__device__ __forceinline__ void load8(unsigned (&w)[4 * sizeof(T) / 2], const T* row, int k0, int kend, bool live,
                                      bool vec) {
  constexpr int W = 4 * (int)sizeof(T) / 2;
  if (live && vec && k0 + 8 <= kend) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + k0) + q);
      w[4 * q] = v.x;
      w[4 * q + 1] = v.y;
      w[4 * q + 2] = v.z;
      w[4 * q + 3] = v.w;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < W; ++i) w[i] = 0u;
  if (!live) return;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if (k0 + e < kend) {
      if constexpr (sizeof(T) == 4) {
        w[e] = reinterpret_cast<const unsigned*>(row)[k0 + e];
      } else {
        w[e >> 1] |= (unsigned)reinterpret_cast<const unsigned short*>(row)[k0 + e] << (16 * (e & 1));
      }
    }
  }
}

// The MMA register (and split residue) of elements 2 i, 2 i + 1 of 8 held as words.
template <typename T, typename M, bool SPLIT>
__device__ __forceinline__ void operand(const unsigned (&w)[4 * sizeof(T) / 2], int i, unsigned& hi, unsigned& lo) {
  if constexpr (sizeof(T) == 4) {
    pack_scaled<M, SPLIT>(__uint_as_float(w[2 * i]), __uint_as_float(w[2 * i + 1]), 1.f, hi, lo);
  } else {
    hi = w[i];
  }
}

template <typename T, int BM>
__device__ void shrink_stream_task(const Args<T>& g, int* s_indptr, TileRows<BM>& tr, int u) {
  using C = StreamShrink<T>;
  using M = typename C::M;
  constexpr int MT = BM / 16, WK = 4 / MT;  // m-tiles; warps that take turns on an m-tile's chunks
  constexpr int NTW = C::NTW, W = C::W, D = C::D;
  __shared__ int run_r[BM];  // each run's rank inside this rank block (0..RB)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int R = g.max_rank, n = g.n_slices, in = g.in_features;
  const ShrinkTask task = shrink_task_of<T, BM>(g, u, g.tiles(BM), g.splits);
  const int q = task.q, j = task.j, rb = task.rb, tile = task.tile, p0 = tile * BM;
  read_tile<BM>(tr, s_indptr, g.slot_indptr, g.token_order, g.num_slots, g.positions, p0);
  if (p0 >= tr.pend) return;
  for (int k = tid; k < tr.nrun; k += THREADS)
    run_r[k] = min(max(min(g.ranks[tr.run_slot[k] * n + j], R) - rb * C::RB, 0), C::RB);
  __syncthreads();

  const int m0 = (warp % MT) * 16, kw = warp / MT;
  const int row0 = m0 + gq, row1 = row0 + 8;
  const int tok0 = tr.tok[row0], tok1 = tr.tok[row1];
  int ka, kb;  // the runs meeting this warp's rows, less those of rank 0 at either end
  runs_meeting<BM>(tr, m0, ka, kb);
  while (ka <= kb && run_r[ka] == 0) ++ka;
  while (kb >= ka && run_r[kb] == 0) --kb;
  const int kbeg = q * g.k_split, kend = min(kbeg + g.k_split, in);
  const int chunks = kend > kbeg ? (kend - kbeg + C::KW - 1) / C::KW : 0;
  const int mine = kw < chunks ? (chunks - kw + WK - 1) / WK : 0;  // chunks kw, kw + WK, ...
  const int steps = kb >= ka ? (kb - ka + 1) * mine : 0;
  const bool vec = g.flags & 1;
  const size_t a_slot = (size_t)n * R * in;

  // x and A of step (run k, chunk kw + WK c): lane (g, tq) holds rows g, g + 8 and ranks 8 nt + g,
  // features k0 + 8 tq .. + 7 of the chunk
  auto load = [&](unsigned (&xw)[2][W], unsigned (&aw)[NTW][W], int k, int c) {
    const int k0 = kbeg + (kw + WK * c) * C::KW + 8 * tq;
    const int lo = tr.run_lo[k], hi = tr.run_hi[k], r = run_r[k];
    load8<T>(xw[0], g.x + (size_t)max(tok0, 0) * in, k0, kend, r > 0 && row0 >= lo && row0 < hi, vec);
    load8<T>(xw[1], g.x + (size_t)max(tok1, 0) * in, k0, kend, r > 0 && row1 >= lo && row1 < hi, vec);
    const T* a0 = g.A + tr.run_slot[k] * a_slot + ((size_t)j * R + rb * C::RB) * in;
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      if (nt * 8 < r) load8<T>(aw[nt], a0 + (size_t)(nt * 8 + gq) * in, k0, kend, nt * 8 + gq < r, vec);
    }
  };
  float acc[NTW][4];
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  auto compute = [&](const unsigned (&xw)[2][W], const unsigned (&aw)[NTW][W], int k) {
    const int r = run_r[k];
#pragma unroll
    for (int s = 0; s < 2; ++s) {  // k-step s: elements 4 s .. 4 s + 3 of each lane's 8
      Frags<M, C::SPLIT, T> fa;
      operand<T, M, C::SPLIT>(xw[0], 2 * s, fa.a[0], fa.al[0]);
      operand<T, M, C::SPLIT>(xw[1], 2 * s, fa.a[1], fa.al[1]);
      operand<T, M, C::SPLIT>(xw[0], 2 * s + 1, fa.a[2], fa.al[2]);
      operand<T, M, C::SPLIT>(xw[1], 2 * s + 1, fa.a[3], fa.al[3]);
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt) {
        if (nt * 8 < r) {
          Frags<M, C::SPLIT, T> fb;
          operand<T, M, C::SPLIT>(aw[nt], 2 * s, fb.b[0], fb.bl[0]);
          operand<T, M, C::SPLIT>(aw[nt], 2 * s + 1, fb.b[1], fb.bl[1]);
          mma_frags<M, C::SPLIT, C::SPLIT>(acc[nt], fa, fb);
        }
      }
    }
  };

  // steps i = 0 .. steps - 1 walk (run, chunk); x and A of step i live in buffer i % D
  unsigned xb[D][2][W], ab[D][NTW][W];
  int kl = ka, cl = 0, kc = ka, cc = 0;  // (run, chunk) of the next load and of the next compute
  auto next = [&](int& k, int& c) {
    if (++c == mine) {
      c = 0;
      ++k;
    }
  };
#pragma unroll
  for (int b = 0; b < D; ++b) {
    if (b < steps) {
      load(xb[b], ab[b], kl, cl);
      next(kl, cl);
    }
  }
  for (int i = 0; i < steps; ++i) {
    const int cur = i % D;
#pragma unroll
    for (int b = 0; b < D; ++b) {  // static buffer indices: x and A stay in registers
      if (b == cur) {
        compute(xb[b], ab[b], kc);
        if (i + D < steps) {
          load(xb[b], ab[b], kl, cl);
          next(kl, cl);
        }
      }
    }
    next(kc, cc);
  }

  // lanes tq and tq ^ 1 swap halves so each holds four consecutive ranks of one row; ranks in
  // [r, r rounded up to 16) carry zeros, later ones are not written
  if (steps > 0) {
    const bool odd = tq & 1;
    const int row = odd ? row1 : row0, tok = odd ? tok1 : tok0;
    const int r16 = tok >= 0 ? (run_r[tr.run_of[row]] + 15) & ~15 : 0;
    const bool store = g.splits == 1 && WK == 1;  // one writer per element of v
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const float s0 = odd ? acc[nt][0] : acc[nt][2], s1 = odd ? acc[nt][1] : acc[nt][3];
      const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
      const float4 quad = odd ? make_float4(r0, r1, acc[nt][2], acc[nt][3]) : make_float4(acc[nt][0], acc[nt][1], r0, r1);
      const int col = nt * 8 + 2 * (tq & ~1);
      if (col < r16) {
        float* p = g.ws + ((size_t)(p0 + row) * n + j) * g.rw + rb * C::RB + col;
        if (store) *reinterpret_cast<float4*>(p) = quad;
        else red_add4(p, quad);
      }
    }
  }
}

}  // namespace lora
