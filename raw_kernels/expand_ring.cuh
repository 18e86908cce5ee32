// lora_expand_ring: y[t, cols_j] += scaling[s, j] * v[p, j, :r] @ B[s, cols_j, :r].T for large
// steps. Included by lora_mma.cu (it uses Args, TileRows, RunMeta, read_tile, read_run_meta, the
// expand walk and release_v from there, add_word from expand_stream.cuh).
//
// A block takes one tile of 64 positions and one column group (cpb blocks of 64 columns); warp w
// owns rows [16 w, 16 w + 16) of the tile and every column of a column block. The block walks its
// steps (column block, slice meeting it, run, chunk of RK = 64 ranks, fp32 32) through a ring of
// STAGES shared-memory stages filled by cp.async STAGES - 1 steps ahead: each step's B tile (64
// columns x the chunk's ranks of its run's slot, copied only up to the rank rounded up to 16,
// which is all the MMAs read; zero past the rank and outside the slice) and, at a column block's
// first step, its y tile (64 rows x 64 columns: whole 128-byte lines of a 16-bit y), in a ring of
// its own.
//   - v * scaling is read by each warp into registers as MMA fragments, one rank chunk's worth, each
//     row scaled by its own run's scaling, and read again only when the step's slice or chunk
//     changes: once per slice where ranks fit one chunk, so such a step moves y and B only (a run
//     of rank > 64, fp32 > 32, reads v again at every step, its chunks alternating); rows of other
//     runs are masked out of the fragments per run.
//   - B fragments come from the shared B tile with ranks permuted inside each k-step as the v
//     fragments are (common.cuh): one 8-byte shared load per n-tile (fp32: 16 bytes).
//   - At a column block's last step each warp adds its rows' sums into the y tile (fp32, rounded
//     once; an element whose delta is exactly zero keeps its bits) and writes its 16 rows back
//     (16-byte stores where y allows them, else element by element): no block barrier besides the
//     ring's one per step.
// The last column group of a tile to finish zeroes the tile's v, as lora_expand does. Shared
// memory: 3 stages of (y tile + B tile), 57 KB for 16-bit types (3 blocks per multiprocessor), 90 KB
// for fp32. Chosen by the plan (backends/cupy.py, default_expand) for the buckets where
// it measured fastest.
#pragma once

namespace lora {

template <typename T>
struct Ring {
  using M = typename Op<T>::type;
  static constexpr bool SPLIT = Op<T>::SPLIT;
  static constexpr int BM = 64, BN = 64;  // positions of a tile, columns of a column block
  static constexpr int RK = sizeof(T) == 4 ? 32 : 64;  // ranks of one step's B tile
  static constexpr int KREG = RK / 16;                  // k-steps of v held in registers
  static constexpr int STAGES = 3;
  static constexpr int CH = 16 / sizeof(T);
  // padded rows: the epilogue's 4-byte (fp32: 8-byte) y accesses and the 8-byte (16-byte) B
  // fragment loads of a warp fall in distinct banks
  static constexpr int LDY = BN + 8, LDB = RK + 16;
  static constexpr int Y_BYTES = BM * LDY * (int)sizeof(T), B_BYTES = BN * LDB * (int)sizeof(T);
  static constexpr int SMEM = STAGES * (Y_BYTES + B_BYTES);
};

template <typename T, bool ALIGNED>
__device__ void expand_ring_task(const Args<T>& g, char* dsmem, int* s_indptr, TileRows<64>& tr, int u) {
  using C = Ring<T>;
  using M = typename C::M;
  constexpr int BM = C::BM, BN = C::BN, RK = C::RK, CH = C::CH, STAGES = C::STAGES, KREG = C::KREG;
  constexpr int NT = BN / 8, YCPR = BN / CH;
  __shared__ RunMeta<BM> rm;
  const int(&pr)[MAX_SLICES][BM] = rm.pr;
  const float(&ps)[MAX_SLICES][BM] = rm.ps;
  const int* s_off = rm.s_off;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int groups = g.col_groups(), cg = u % groups, tile = u / groups, p0 = tile * BM;
  read_tile<BM>(tr, s_indptr, g.slot_indptr, g.token_order, g.num_slots, g.positions, p0);
  if (p0 >= tr.pend || tr.nrun == 0) return;
  const int out = g.out_features, n = g.n_slices, nrun = tr.nrun;
  const int cb0 = cg * g.cpb, cb1 = min(cb0 + g.cpb, g.col_blocks);
  read_run_meta<T, BM>(g, tr, rm);

  const bool vec_y = ALIGNED || (g.flags & 4), vec_b = ALIGNED || (g.flags & 2);
  auto y_tile = [&](int vis) { return reinterpret_cast<T*>(dsmem + (vis % STAGES) * C::Y_BYTES); };
  auto b_tile = [&](int st) { return reinterpret_cast<T*>(dsmem + STAGES * C::Y_BYTES + st * C::B_BYTES); };
  // one run of one slice (a large step's common tile): every column block has the same chunks
  const bool simple = n == 1 && nrun == 1 && pr[0][0] > 0;
  auto step = [&](ExpandWalk& w, bool newcb) {
    if (simple && !newcb) {
      if (++w.kc < w.nc) {
        w.first = false;
        return;
      }
      w.kc = 0;
      w.first = true;
      ++w.vis;
      w.done = ++w.cb >= cb1;
      return;
    }
    walk_step<BM>(w, newcb, rm, n, nrun, out, BN, cb1, RK);
  };
  // each thread's share of a y tile: rows yr0 + k * YROWS, one 16-byte piece at column ycol
  constexpr int YPT = BM * YCPR / THREADS, YROWS = THREADS / YCPR;
  const int ycol = (tid % YCPR) * CH, yr0 = tid / YCPR;
  const T* yrow[YPT];
#pragma unroll
  for (int k = 0; k < YPT; ++k) {
    const int t = tr.tok[yr0 + k * YROWS];
    yrow[k] = t >= 0 ? g.y + (size_t)t * out + ycol : nullptr;
  }
  // and of a B tile: columns br0 + k * BROWS, the 16-byte piece at rank bk of each
  constexpr int BPR = RK / CH, BPT = BN * BPR / THREADS, BROWS = THREADS / BPR;
  const int bk = (tid % BPR) * CH, br0 = tid / BPR;

  // one step's loads into stage st: its y tile (a column block's first step) and its B tile
  auto load = [&](const ExpandWalk& w, int st) {
    if (!w.done) {
      const int c0 = w.cb * BN, c1 = min(c0 + BN, out);
      if (w.first) {
        T* sy = y_tile(w.vis);
        if (vec_y) {
          if (c0 + ycol < c1) {
#pragma unroll
            for (int k = 0; k < YPT; ++k)
              if (yrow[k]) cp_async16_l2(sy + (yr0 + k * YROWS) * C::LDY + ycol, yrow[k] + c0, 16, g.copies_l2_only());
          }
        } else {
          for (int e = tid; e < BM * BN; e += THREADS) {
            const int row = e / BN, col = e % BN;
            if (tr.tok[row] >= 0 && c0 + col < c1) sy[row * C::LDY + col] = g.y[(size_t)tr.tok[row] * out + c0 + col];
          }
        }
      }
      T* sb = b_tile(st);
      const int s = tr.run_slot[w.run], r = pr[w.j][w.run], k0 = w.kc * RK;
      const int ca = max(c0, s_off[w.j]), cz = min(c1, s_off[w.j + 1]);
      const int kw = min(((r - k0) + 15) & ~15, RK);  // ranks < r rounded up to 16: all the MMAs read
      const T* bs = g.B + (size_t)s * g.b_slot;
      if (vec_b) {
        if (bk < kw) {  // the pieces of ranks < r16 (the others are never read)
          const int bytes = min(max(r - (k0 + bk), 0), CH) * (int)sizeof(T);
#pragma unroll
          for (int k = 0; k < BPT; ++k) {
            const int row = br0 + k * BROWS, col = c0 + row;
            const bool ok = col >= ca && col < cz && bytes > 0;
            cp_async16_l2(sb + row * C::LDB + bk, ok ? bs + g.b_at(col, k0 + bk) : g.B, ok ? bytes : 0,
                          g.copies_l2_only());
          }
        }
      } else {
        for (int e = tid; e < BN * kw; e += THREADS) {
          const int row = e / kw, k = e % kw, col = c0 + row;
          const bool ok = col >= ca && col < cz && k0 + k < r;
          sb[row * C::LDB + k] = ok ? bs[g.b_at(col, k0 + k)] : from_float<T>(0.f);
        }
      }
    }
    cp_async_commit();
  };

  // this warp's rows and their v fragments: k-steps [vkb, vkb + KREG) of slice vj, each row times
  // its own run's scaling (zero for rows that address nothing)
  const int m0 = warp * 16, row0 = m0 + gq, row1 = row0 + 8;
  const int tok0 = tr.tok[row0], tok1 = tr.tok[row1];
  Frags<M, C::SPLIT, float> vreg[KREG];
  int vj = -1, vkb = -1;
  auto load_v = [&](int j, int kb) {
    int kmax = 0;  // the largest rank of slice j among the runs meeting this warp's rows
    for (int k = 0; k < nrun; ++k)
      if (tr.run_lo[k] < m0 + 16 && tr.run_hi[k] > m0) kmax = max(kmax, pr[j][k]);
    const float sc0 = tok0 >= 0 ? ps[j][tr.run_of[row0]] : 0.f, sc1 = tok1 >= 0 ? ps[j][tr.run_of[row1]] : 0.f;
    const size_t stride = (size_t)n * g.rw;
    const float* base = g.ws + ((size_t)p0 * n + j) * g.rw + 4 * tq;
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int q = 0; q < KREG; ++q) {
      const int ks = kb + q;
      const bool live = ks * 16 < kmax;
      const float4 f0 = live && tok0 >= 0 ? *reinterpret_cast<const float4*>(base + ks * 16 + row0 * stride) : z;
      const float4 f1 = live && tok1 >= 0 ? *reinterpret_cast<const float4*>(base + ks * 16 + row1 * stride) : z;
      pack_scaled<M, C::SPLIT>(f0.x, f0.y, sc0, vreg[q].a[0], vreg[q].al[0]);
      pack_scaled<M, C::SPLIT>(f1.x, f1.y, sc1, vreg[q].a[1], vreg[q].al[1]);
      pack_scaled<M, C::SPLIT>(f0.z, f0.w, sc0, vreg[q].a[2], vreg[q].al[2]);
      pack_scaled<M, C::SPLIT>(f1.z, f1.w, sc1, vreg[q].a[3], vreg[q].al[3]);
    }
    vj = j;
    vkb = kb;
  };

  float acc[NT][4];
  auto clear = [&]() {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  };
  clear();

  // acc += this warp's rows of the step's run (v fragments masked to them) times its B tile
  auto compute = [&](const ExpandWalk& w, int st) {
    const int lo = tr.run_lo[w.run], hi = tr.run_hi[w.run];
    if (!(lo < m0 + 16 && hi > m0)) return;  // warp-uniform: the run has none of this warp's rows
    const bool in0 = row0 >= lo && row0 < hi, in1 = row1 >= lo && row1 < hi;
    const int r = pr[w.j][w.run] - w.kc * RK;  // ranks left from this chunk on
    if (vj != w.j || vkb != w.kc * KREG) load_v(w.j, w.kc * KREG);
    const T* sb = b_tile(st) + gq * C::LDB + 4 * tq;
#pragma unroll
    for (int q = 0; q < KREG; ++q) {
      if (q * 16 < r) {
        Frags<M, C::SPLIT, float> fa = vreg[q];
        if (!in0) fa.a[0] = fa.a[2] = fa.al[0] = fa.al[2] = 0u;
        if (!in1) fa.a[1] = fa.a[3] = fa.al[1] = fa.al[3] = 0u;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          Frags<M, C::SPLIT, T> fb;
          const T* p = sb + nt * 8 * C::LDB + q * 16;
          if constexpr (sizeof(T) == 2) {
            const uint2 qv = *reinterpret_cast<const uint2*>(p);
            fb.b[0] = qv.x;
            fb.b[1] = qv.y;
          } else {
            const float4 f = *reinterpret_cast<const float4*>(p);
            pack_scaled<M, C::SPLIT>(f.x, f.y, 1.f, fb.b[0], fb.bl[0]);
            pack_scaled<M, C::SPLIT>(f.z, f.w, 1.f, fb.b[1], fb.bl[1]);
          }
          mma_frags<M, C::SPLIT, C::SPLIT>(acc[nt], fa, fb);
        }
      }
    }
  };

  // a finished column block: this warp's rows of its y tile plus acc, written back to y
  auto finish = [&](int cb, int vis) {
    T* sy = y_tile(vis);
    const int c0 = cb * BN, c1 = min(c0 + BN, out);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if ((h ? tok1 : tok0) < 0) continue;
        T* p = sy + (h ? row1 : row0) * C::LDY + nt * 8 + 2 * tq;  // past c1: zero sums, bits kept
        if constexpr (sizeof(T) == 4) {  // one 8-byte access: the lanes of a half-warp in distinct banks
          uint2* wp = reinterpret_cast<uint2*>(p);
          const uint2 w = *wp;
          *wp = make_uint2(add_word<T>(w.x, acc[nt][2 * h], 0.f), add_word<T>(w.y, acc[nt][2 * h + 1], 0.f));
        } else {
          unsigned* wp = reinterpret_cast<unsigned*>(p);
          const float d0 = acc[nt][2 * h], d1 = acc[nt][2 * h + 1];
          const unsigned w = *wp;
          if (d0 != 0.f && d1 != 0.f) {  // both change: no bits to keep
            const float2 f = unpack2<T>(w);
            *wp = pack2<T>(f.x + d0, f.y + d1);
          } else {
            *wp = add_word<T>(w, d0, d1);
          }
        }
      }
    clear();
    __syncwarp();
    if (vec_y) {
#pragma unroll
      for (int c = lane; c < 16 * YCPR; c += 32) {
        const int row = m0 + c / YCPR, col = (c % YCPR) * CH;
        if (tr.tok[row] >= 0 && c0 + col < c1)
          *reinterpret_cast<uint4*>(g.y + (size_t)tr.tok[row] * out + c0 + col) =
              *reinterpret_cast<const uint4*>(sy + row * C::LDY + col);
      }
    } else {
      for (int e = lane; e < 16 * BN; e += 32) {
        const int row = m0 + e / BN, col = e % BN;
        if (tr.tok[row] >= 0 && c0 + col < c1) g.y[(size_t)tr.tok[row] * out + c0 + col] = sy[row * C::LDY + col];
      }
    }
  };

  ExpandWalk wp = walk_start<BM>(rm, n, nrun, out, BN, cb0, cb1, RK);
  ExpandWalk wc = wp;
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    load(wp, st);
    if (!wp.done) step(wp, false);
  }
  if (!wc.done) load_v(wc.j, 0);  // the first slice's v while the first stages load
  for (int f = 0; !wc.done; ++f) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // step f's stage has landed for every thread; stage f - 1 is free
    load(wp, (f + STAGES - 1) % STAGES);
    if (!wp.done) step(wp, false);
    compute(wc, f % STAGES);
    const int cb = wc.cb, vis = wc.vis;
    step(wc, false);
    if (wc.done || wc.cb != cb) finish(cb, vis);
  }
  cp_async_wait<0>();

  release_v<T, BM>(g, tr, rm, tile, groups, p0, n);
}

}  // namespace lora
