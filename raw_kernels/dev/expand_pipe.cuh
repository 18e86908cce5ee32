// The v5 ("pipe") expand: y[t, cols_j] += scaling[s, j] * v[p, j, :r] @ B[s, cols_j, :r].T, with
// each warp running its own cp.async pipeline over its 16 rows of y. Included by lora_mma.cu (it
// uses Args, TileRows, read_tile and release_v from there).
//
// A block takes one tile of BM positions and one column group (cpb chunks of one 128-byte line of
// each row: 64 columns of bf16 / fp16, 32 of fp32). Its warps split the tile into m-tiles of 16
// rows; when BM < 64 the warps of one m-tile take its chunks in turn. After the block has read
// the tile's runs, ranks and scalings, every warp works on its own, with no block barrier:
//   - y of the next DEPTH - 1 chunks is in flight in the warp's ring of shared-memory stages
//     (cp.async, 16 bytes a lane, whole lines of each row): bytes in flight cost no registers;
//   - v * scaling and B fragments come straight from global memory (L1 / L2) with ranks permuted
//     inside each k-step (common.cuh): a warp with one run of one slice (rank <= 64) keeps its v
//     fragments in registers and loads the next chunk's first k-step of B one chunk ahead;
//   - the sum is added to the stage in fp32 and rounded once (an element whose delta is exactly
//     zero keeps its bits), and the stage goes back to y as whole lines with 16-byte stores;
//   - rows of slot 0 and padding are neither read nor written.
// The last column group of a tile to finish zeroes the tile's v, as in the v3 expand.
#pragma once

// Measurement only (wrong results): 1 = the v5 kernels skip their fragments and MMAs, 2 = the
// expand also skips its adds, streaming y back as it came (raw_kernels/NOTES.md, v5 probes).
#ifndef LORA_PIPE_PROBE
#define LORA_PIPE_PROBE 0
#endif
#ifndef LORA_EXPAND_PIPE_KREG
#define LORA_EXPAND_PIPE_KREG 2  // k-steps of v a warp keeps in registers (ranks up to 16 x this)
#endif

namespace lora {

// One warp's ring of row stages, shared by the v5 shrink and expand: 16 rows of one 128-byte line
// each, padded by 16 bytes so fragment reads of 8 rows x 4 lanes meet no bank twice.
template <typename T>
struct Pipe {
  static constexpr int COLS = 128 / (int)sizeof(T);       // elements of a row per stage
  static constexpr int CH = 16 / (int)sizeof(T);          // elements per 16-byte copy
  static constexpr int LD = COLS + CH;                    // padded row, elements
  static constexpr int STAGE = 16 * LD;                   // elements of one stage
  static constexpr int DEPTH = 5;                         // stages per warp (DEPTH - 1 in flight)
  static constexpr int SMEM = 4 * DEPTH * STAGE * (int)sizeof(T);  // bytes per block of 4 warps
  static constexpr int NT = COLS / 8;                     // n-tiles of an expand chunk
};

// The 16-byte copies of one stage a lane makes: row (lane >> 3) + 4 i, column chunk lane & 7.
__device__ __forceinline__ int pipe_row(int lane, int i) { return (lane >> 3) + 4 * i; }

template <typename T, int BM>
__device__ void expand_pipe_task(const Args<T>& g, char* dsmem, int* s_indptr, TileRows<BM>& tr, int u) {
  using C = Pipe<T>;
  using M = typename Op<T>::type;
  constexpr bool SPLIT = Op<T>::SPLIT;
  constexpr int MT = BM / 16, WC = 4 / MT;  // m-tiles; warps that share an m-tile's chunks
  constexpr int NT = C::NT, D = C::DEPTH;
  __shared__ RunMeta<BM> rm;
  const int(&pr)[MAX_SLICES][BM] = rm.pr;
  const float(&ps)[MAX_SLICES][BM] = rm.ps;
  const int* s_off = rm.s_off;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int groups = g.col_groups(), cg = u % groups, tile = u / groups, p0 = tile * BM;
  read_tile<BM>(tr, s_indptr, g.slot_indptr, g.token_order, g.num_slots, g.positions, p0);
  if (p0 >= tr.pend || tr.nrun == 0) return;
  const int out = g.out_features, n = g.n_slices, nrun = tr.nrun, R = g.max_rank;
  read_run_meta<T, BM>(g, tr, rm);

  const int m0 = (warp % MT) * 16, cl = warp / MT;
  const int row0 = m0 + gq, row1 = row0 + 8;
  const bool live0 = tr.tok[row0] >= 0, live1 = tr.tok[row1] >= 0;
  int ka, kb;  // the runs meeting this warp's rows
  runs_meeting<BM>(tr, m0, ka, kb);
  const int first = g.cpb * cg + cl, last = min(g.cpb * (cg + 1), g.col_blocks);
  const int passes = kb >= 0 && first < last ? (last - first + WC - 1) / WC : 0;
  const bool vec_y = g.flags & 4, vec_b = g.flags & 2;
  T* ring = reinterpret_cast<T*>(dsmem) + warp * D * C::STAGE;
  const int cc = (lane & 7) * C::CH;  // this lane's column inside a stage row, for the copies
  int ctok[4];                        // token rows of this lane's copies (-1: nothing there)
#pragma unroll
  for (int i = 0; i < 4; ++i) ctok[i] = tr.tok[m0 + pipe_row(lane, i)];

  // y of chunk i of this warp into stage i % D
  auto issue = [&](int i) {
    if (i < passes) {
      const int c0 = (first + WC * i) * C::COLS;
      T* st = ring + (i % D) * C::STAGE;
      if (vec_y) {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (ctok[q] >= 0 && c0 + cc < out)
            cp_async16(st + pipe_row(lane, q) * C::LD + cc, g.y + (size_t)ctok[q] * out + c0 + cc, 16);
      } else {
        for (int e = lane; e < 16 * C::COLS; e += 32) {
          const int row = e / C::COLS, col = e % C::COLS, t = tr.tok[m0 + row];
          if (t >= 0 && c0 + col < out) st[row * C::LD + col] = g.y[(size_t)t * out + c0 + col];
        }
      }
    }
    cp_async_commit();
  };

  float acc[NT][4];
  auto compute = [&](int c0) {  // acc = the delta of columns [c0, c0 + COLS) for this warp's rows
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    const int c1 = min(c0 + C::COLS, out);
    int j0 = 0;  // the slices meeting columns [c0, c1)
    while (j0 + 1 < n && s_off[j0 + 1] <= c0) ++j0;
    for (int j = j0; j < n && s_off[j] < c1; ++j) {
      const int ca = max(c0, s_off[j]), cz = min(c1, s_off[j + 1]);
      for (int k = ka; k <= kb; ++k) {
        const int r = pr[j][k], lo = tr.run_lo[k], hi = tr.run_hi[k];
        const T* bs = g.B + (size_t)tr.run_slot[k] * out * R;
        const float* vb = g.ws + ((size_t)p0 * n + j) * g.rw + 4 * tq;
        for (int ks = 0; ks * 16 < r; ++ks) {
          Frags<M, SPLIT, float> fa;
          load_frag_rows<M, SPLIT>(fa, vb + ks * 16, (size_t)n * g.rw, row0, row0 >= lo && row0 < hi,
                                   row1 >= lo && row1 < hi, ps[j][k]);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const int col = c0 + nt * 8 + gq;
            Frags<M, SPLIT, T> fb;
            load_frag_col<T, M, SPLIT>(fb, bs, R, col, col >= ca && col < cz, ks * 16 + 4 * tq, r, vec_b);
            mma_frags<M, SPLIT, SPLIT>(acc[nt], fa, fb);
          }
        }
      }
    }
  };

  // A warp whose rows are one run of one slice of rank <= 16 KREG keeps that run's v * scaling
  // fragments in registers, and loads the B fragments of its next chunk's first k-step while it
  // works on this one: no load of the loop waits on memory but those of ranks past 16.
  constexpr int KREG = LORA_EXPAND_PIPE_KREG;
  const bool cached = n == 1 && kb >= 0 && ka == kb && pr[0][ka] > 0 && pr[0][ka] <= 16 * KREG;
  Frags<M, SPLIT, float> vc[KREG];
  Frags<M, SPLIT, T> bnext[NT];
  const T* bs_c = cached ? g.B + (size_t)tr.run_slot[ka] * out * R : g.B;
  const int r_c = cached ? pr[0][ka] : 0;
  auto load_b0 = [&](int i) {  // B fragments of chunk i, k-step 0
    const int c0 = (first + WC * i) * C::COLS, c1 = min(c0 + C::COLS, out);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = c0 + nt * 8 + gq;
      load_frag_col<T, M, SPLIT>(bnext[nt], bs_c, R, col, col < c1, 4 * tq, r_c, vec_b);
    }
  };
  if (cached && passes > 0) {
    const int lo = tr.run_lo[ka], hi = tr.run_hi[ka];
    const float* vb = g.ws + (size_t)p0 * g.rw + 4 * tq;
#pragma unroll
    for (int ks = 0; ks < KREG; ++ks)
      if (ks * 16 < r_c)
        load_frag_rows<M, SPLIT>(vc[ks], vb + ks * 16, (size_t)g.rw, row0, row0 >= lo && row0 < hi,
                                 row1 >= lo && row1 < hi, ps[0][ka]);
    load_b0(0);
  }

#pragma unroll
  for (int i = 0; i < D - 1; ++i) issue(i);
  for (int i = 0; i < passes; ++i) {
    cp_async_wait<D - 2>();
    __syncwarp();
    issue(i + D - 1);  // into the stage chunk i - 1 used: its stores read it before the barrier above
    const int c0 = (first + WC * i) * C::COLS;
    if (LORA_PIPE_PROBE >= 1) {  // measurement only: no fragments, no MMA
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    } else if (cached) {
      Frags<M, SPLIT, T> bcur[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) bcur[nt] = bnext[nt];
      if (i + 1 < passes) load_b0(i + 1);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
        mma_frags<M, SPLIT, SPLIT>(acc[nt], vc[0], bcur[nt]);
      }
      const int c1 = min(c0 + C::COLS, out);
#pragma unroll
      for (int ks = 1; ks < KREG; ++ks) {
        if (ks * 16 < r_c) {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const int col = c0 + nt * 8 + gq;
            load_frag_col<T, M, SPLIT>(bcur[nt], bs_c, R, col, col < c1, ks * 16 + 4 * tq, r_c, vec_b);
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma_frags<M, SPLIT, SPLIT>(acc[nt], vc[ks], bcur[nt]);
        }
      }
    } else {
      compute(c0);
    }
    T* st = ring + (i % D) * C::STAGE;
    // add in the MMA layout: lane (gq, tq) holds rows gq, gq + 8, columns 8 nt + 2 tq, + 1
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = nt * 8 + 2 * tq;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (LORA_PIPE_PROBE < 2 && (h ? live1 : live0) && c0 + col < out) {
          T* p = st + (gq + 8 * h) * C::LD + col;
          if constexpr (sizeof(T) == 4) {
            float2 w = *reinterpret_cast<float2*>(p);
            if (acc[nt][2 * h] != 0.f) w.x += acc[nt][2 * h];
            if (acc[nt][2 * h + 1] != 0.f) w.y += acc[nt][2 * h + 1];
            *reinterpret_cast<float2*>(p) = w;  // a column past out is never stored
          } else {
            unsigned* q = reinterpret_cast<unsigned*>(p);
            *q = add_word<T>(*q, acc[nt][2 * h], acc[nt][2 * h + 1]);
          }
        }
      }
    }
    __syncwarp();
    if (vec_y) {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (ctok[q] >= 0 && c0 + cc < out)
          *reinterpret_cast<uint4*>(g.y + (size_t)ctok[q] * out + c0 + cc) =
              *reinterpret_cast<const uint4*>(st + pipe_row(lane, q) * C::LD + cc);
    } else {
      for (int e = lane; e < 16 * C::COLS; e += 32) {
        const int row = e / C::COLS, col = e % C::COLS, t = tr.tok[m0 + row];
        if (t >= 0 && c0 + col < out) g.y[(size_t)t * out + c0 + col] = st[row * C::LD + col];
      }
    }
  }
  cp_async_wait<0>();

  release_v<T, BM>(g, tr, rm.pr, rm.last_reader, tile, groups, p0, n);
}

}  // namespace lora
