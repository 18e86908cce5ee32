// lora_expand_stream: y[t, cols_j] += scaling[s, j] * v[p, j, :r] @ B[s, cols_j, :r].T,
// with each warp streaming its rows of y like a copy kernel. Included by lora_mma.cu (it uses Args,
// TileRows and read_tile from there).
//
// A block takes one tile of BM positions and one column group (cpb passes of BN columns). Its warps
// split the tile into m-tiles of 16 rows; when BM < 64, the warps of one m-tile take its passes in
// turn. After the block has read the tile's runs, ranks and scalings, every warp works on its own:
// no shared memory and no barrier until the end.
//   - y of the next NBUF - 1 passes is in flight in registers, loaded with 16-byte loads straight
//     into the MMA accumulator layout: output columns and ranks are permuted inside a pass so that
//     each lane's accumulators for a row are 8 consecutive columns (and its B fragment of a k-step
//     is 4 consecutive ranks: one 8-byte load, 16 for fp32);
//   - a warp whose 16 rows hold one run of one slice keeps that run's v fragments (v * scaling,
//     rounded to the MMA type) in registers for every pass; otherwise they are read again each pass
//     (from L1);
//   - B fragments are read from global memory (L1 / L2: every warp of a tile reads the same B);
//   - the sum is added to y in fp32 and rounded once; an element whose delta is exactly zero keeps
//     its bits, rows of slot 0 and padding are neither read nor written.
// ALIGNED (flags == 7 only): y moves in 16-byte pieces, each wholly inside or past the row, and B
// fragments are one vector load with the elements past the rank selected to zero: no element-wise code.
// The last column group of a tile to finish zeroes the tile's v, as lora_expand does. Chosen for
// unfused launches of the buckets in STREAM_EXPAND_BUCKETS (backends/cupy.py): 256 positions, where
// it measured 7-23% faster than lora_expand (no shared-memory pipeline to fill, little y to move).
#pragma once

namespace lora {

template <typename T>
struct Stream {
  using M = typename Op<T>::type;
  static constexpr bool SPLIT = Op<T>::SPLIT;
  static constexpr int BN = 32;                        // columns of one pass
  static constexpr int NT = BN / 8;                     // n-tiles of one pass
  static constexpr int NCH = BN / 32;                   // 8-column chunks a lane holds per row
  static constexpr int W = 4 * (int)sizeof(T) / 2;      // 32-bit words of one chunk
  static constexpr int NBUF = sizeof(T) == 4 ? 2 : 3;   // passes of y held in registers
  static constexpr int KREG = sizeof(T) == 4 ? 0 : 4;   // k-steps of v kept in registers (64 ranks)
};

// The column (inside a pass) of B row g of n-tile nt: lane (g, tq)'s accumulators of n-tile nt are
// then columns 32 (nt / 4) + 8 tq + 2 (nt % 4) + {0, 1}, eight consecutive columns per chunk.
__device__ __forceinline__ int stream_col(int nt, int g) {
  return (nt >> 2) * 32 + (g >> 1) * 8 + (nt & 3) * 2 + (g & 1);
}

// y_old + d in fp32 rounded once, or y_old's bits where d is exactly zero: one 32-bit word.
template <typename T>
__device__ __forceinline__ unsigned add_word(unsigned w, float d0, float d1) {
  if constexpr (sizeof(T) == 4) {
    return d0 != 0.f ? __float_as_uint(__uint_as_float(w) + d0) : w;
  } else {
    const float2 f = unpack2<T>(w);
    const unsigned sum = pack2<T>(f.x + d0, f.y + d1);
    const unsigned keep = (d0 != 0.f ? 0x0000ffffu : 0u) | (d1 != 0.f ? 0xffff0000u : 0u);
    return (sum & keep) | (w & ~keep);
  }
}

template <typename T, int BM, bool ALIGNED>
__device__ void expand_stream_task(const Args<T>& g, int* s_indptr, TileRows<BM>& tr, int u) {
  using C = Stream<T>;
  using M = typename C::M;
  constexpr int MT = BM / 16, WC = 4 / MT;  // m-tiles; warps that share an m-tile's passes
  constexpr int NT = C::NT, NCH = C::NCH, W = C::W, NBUF = C::NBUF, KREG = C::KREG;
  __shared__ RunMeta<BM> rm;
  const int(&pr)[MAX_SLICES][BM] = rm.pr;
  const float(&ps)[MAX_SLICES][BM] = rm.ps;
  const int* s_off = rm.s_off;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int groups = g.col_groups(), cg = u % groups, tile = u / groups, p0 = tile * BM;
  read_tile<BM>(tr, s_indptr, g.slot_indptr, g.token_order, g.num_slots, g.positions, p0);
  if (p0 >= tr.pend || tr.nrun == 0) return;
  const int out = g.out_features, n = g.n_slices, nrun = tr.nrun;
  read_run_meta<T, BM>(g, tr, rm);

  const int m0 = (warp % MT) * 16, cl = warp / MT;
  const int row0 = m0 + gq, row1 = row0 + 8;
  const int tok0 = tr.tok[row0], tok1 = tr.tok[row1];
  int ka, kb;  // the runs meeting this warp's rows
  runs_meeting<BM>(tr, m0, ka, kb);
  const int first = g.cpb * cg + cl, last = min(g.cpb * (cg + 1), g.col_blocks);
  const int passes = kb >= 0 && first < last ? (last - first + WC - 1) / WC : 0;
  const bool vec_y = ALIGNED || (g.flags & 4), vec_b = ALIGNED || (g.flags & 2);

  // v fragments of (run k, slice j, k-step ks): rows outside the run are zero
  auto v_frag = [&](Frags<M, C::SPLIT, float>& fa, int k, int j, int ks) {
    const int lo = tr.run_lo[k], hi = tr.run_hi[k];
    load_frag_rows<M, C::SPLIT>(fa, g.ws + ((size_t)p0 * n + j) * g.rw + ks * 16 + 4 * tq, (size_t)n * g.rw, row0,
                                row0 >= lo && row0 < hi, row1 >= lo && row1 < hi, ps[j][k]);
  };
  // B fragment of column col (zero outside [ca, cz)), ranks 16 ks + 4 tq .. + 3 (zero from r on)
  auto b_frag = [&](Frags<M, C::SPLIT, T>& fb, const T* bs, int col, int ca, int cz, int r, int ks) {
    load_frag_col<T, M, C::SPLIT, ALIGNED>(fb, bs + (size_t)ks * g.b_blk, g.b_ld, col, col >= ca && col < cz, 4 * tq,
                                           r - 16 * ks, vec_b);
  };

  // a warp with one run of one slice keeps that run's v fragments for every pass
  const bool cached = KREG > 0 && n == 1 && ka == kb && pr[0][max(ka, 0)] <= 16 * KREG;
  Frags<M, C::SPLIT, float> vc[KREG > 0 ? KREG : 1];
  if (cached && passes > 0) {
#pragma unroll
    for (int ks = 0; ks < KREG; ++ks)
      if (ks * 16 < pr[0][ka]) v_frag(vc[ks], ka, 0, ks);
  }

  float acc[NT][4];
  auto compute = [&](int cb) {  // acc = the delta of pass cb, in the permuted layout
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    const int c0 = cb * C::BN, c1 = min(c0 + C::BN, out);
    if (cached) {
      const int r = pr[0][ka];
      const T* bs = g.B + (size_t)tr.run_slot[ka] * g.b_slot;
#pragma unroll
      for (int ks = 0; ks < KREG; ++ks) {
        if (ks * 16 < r) {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            Frags<M, C::SPLIT, T> fb;
            b_frag(fb, bs, c0 + stream_col(nt, gq), c0, c1, r, ks);
            mma_frags<M, C::SPLIT, C::SPLIT>(acc[nt], vc[ks], fb);
          }
        }
      }
      return;
    }
    int j0 = 0;  // the slices meeting columns [c0, c1)
    while (j0 + 1 < n && s_off[j0 + 1] <= c0) ++j0;
    for (int j = j0; j < n && s_off[j] < c1; ++j) {
      const int ca = max(c0, s_off[j]), cz = min(c1, s_off[j + 1]);
      for (int k = ka; k <= kb; ++k) {
        const int r = pr[j][k];
        const T* bs = g.B + (size_t)tr.run_slot[k] * g.b_slot;
        for (int ks = 0; ks * 16 < r; ++ks) {
          Frags<M, C::SPLIT, float> fa;
          v_frag(fa, k, j, ks);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            Frags<M, C::SPLIT, T> fb;
            b_frag(fb, bs, c0 + stream_col(nt, gq), ca, cz, r, ks);
            mma_frags<M, C::SPLIT, C::SPLIT>(acc[nt], fa, fb);
          }
        }
      }
    }
  };

  // y of pass cb for this lane's two rows: chunk ch of row h is columns c0 + 32 ch + 8 tq .. + 7
  auto load_y = [&](unsigned (&yb)[2][NCH][W], int cb) {
    const int c0 = cb * C::BN;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = h ? tok1 : tok0;
      if (t < 0) continue;
      const T* yr = g.y + (size_t)t * out;
#pragma unroll
      for (int ch = 0; ch < NCH; ++ch) {
        const int col = c0 + ch * 32 + 8 * tq;
        if constexpr (ALIGNED) {  // out % (16 / sizeof(T)) == 0: each 16 bytes wholly in or past the row
#pragma unroll
          for (int q = 0; q < W / 4; ++q) {
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (col + (q + 1) * (16 / (int)sizeof(T)) <= out) v = __ldcs(reinterpret_cast<const uint4*>(yr + col) + q);
            yb[h][ch][4 * q] = v.x;
            yb[h][ch][4 * q + 1] = v.y;
            yb[h][ch][4 * q + 2] = v.z;
            yb[h][ch][4 * q + 3] = v.w;
          }
        } else if (vec_y && col + 8 <= out) {
#pragma unroll
          for (int q = 0; q < W / 4; ++q) {
            const uint4 v = __ldcs(reinterpret_cast<const uint4*>(yr + col) + q);
            yb[h][ch][4 * q] = v.x;
            yb[h][ch][4 * q + 1] = v.y;
            yb[h][ch][4 * q + 2] = v.z;
            yb[h][ch][4 * q + 3] = v.w;
          }
        } else {
#pragma unroll
          for (int w = 0; w < W; ++w) yb[h][ch][w] = 0u;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            if (col + e < out) {
              if constexpr (sizeof(T) == 4) {
                yb[h][ch][e] = reinterpret_cast<const unsigned*>(yr)[col + e];
              } else {
                const unsigned bits = reinterpret_cast<const unsigned short*>(yr)[col + e];
                yb[h][ch][e >> 1] |= bits << (16 * (e & 1));
              }
            }
          }
        }
      }
    }
  };
  // y += acc for pass cb, written back from registers
  auto store_y = [&](unsigned (&yb)[2][NCH][W], int cb) {
    const int c0 = cb * C::BN;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = h ? tok1 : tok0;
      if (t < 0) continue;
      T* yr = g.y + (size_t)t * out;
#pragma unroll
      for (int ch = 0; ch < NCH; ++ch) {
        unsigned nw[W];
#pragma unroll
        for (int w = 0; w < W; ++w) {
          if constexpr (sizeof(T) == 4) {
            nw[w] = add_word<T>(yb[h][ch][w], acc[4 * ch + w / 2][2 * h + (w & 1)], 0.f);
          } else {
            nw[w] = add_word<T>(yb[h][ch][w], acc[4 * ch + w][2 * h], acc[4 * ch + w][2 * h + 1]);
          }
        }
        const int col = c0 + ch * 32 + 8 * tq;
        if constexpr (ALIGNED) {
#pragma unroll
          for (int q = 0; q < W / 4; ++q)
            if (col + (q + 1) * (16 / (int)sizeof(T)) <= out)
              __stcs(reinterpret_cast<uint4*>(yr + col) + q,
                     make_uint4(nw[4 * q], nw[4 * q + 1], nw[4 * q + 2], nw[4 * q + 3]));
        } else if (vec_y && col + 8 <= out) {
#pragma unroll
          for (int q = 0; q < W / 4; ++q)
            __stcs(reinterpret_cast<uint4*>(yr + col) + q,
                   make_uint4(nw[4 * q], nw[4 * q + 1], nw[4 * q + 2], nw[4 * q + 3]));
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            if (col + e < out) {
              if constexpr (sizeof(T) == 4) {
                reinterpret_cast<unsigned*>(yr)[col + e] = nw[e];
              } else {
                reinterpret_cast<unsigned short*>(yr)[col + e] = (unsigned short)(nw[e >> 1] >> (16 * (e & 1)));
              }
            }
          }
        }
      }
    }
  };

  // passes i = 0 .. passes - 1 are column blocks first + WC i; y of pass i lives in buffer i % NBUF
  unsigned yb[NBUF][2][NCH][W];
#pragma unroll
  for (int b = 0; b < NBUF; ++b)
    if (b < passes) load_y(yb[b], first + WC * b);
  for (int i = 0; i < passes; ++i) {
    const int cb = first + WC * i;
    compute(cb);
    const int cur = i % NBUF;
#pragma unroll
    for (int b = 0; b < NBUF; ++b) {  // static buffer indices: y stays in registers
      if (b == cur) {
        store_y(yb[b], cb);
        if (i + NBUF < passes) load_y(yb[b], cb + WC * NBUF);
      }
    }
  }

  release_v<T, BM>(g, tr, rm, tile, groups, p0, n);
}

}  // namespace lora
