// lora_expand_glu: a gated MLP's activation with its gate / up expands folded in, for large steps:
//   h[t, c] = silu(g[t, c] + dg[t, c]) * (u[t, c] + du[t, c]),   c < inter,
//   dg[t, c] = scaling[s, 0] * v[p, 0, :r0] @ B[s, c, :r0].T,   du[t, c] = scaling[s, 1] * v[p, 1, :r1] @ B[s, inter + c, :r1].T
// for every position p < slot_indptr[S] of token_order, t = token_order[p], s its slot, r_j =
// ranks[s, j]: g and u are the outputs of the model's gate and up linears (the base GEMMs), v the
// gate_up target's shrink (lora_shrink, two slices) and B the target's fused [S, 2 * inter, R]. Rows of
// slot 0 get silu(g) * u with no delta (dg = du = 0); without slot_indptr (null) every row t < positions
// is such a row, token_order is not read, and the kernel is the plain fused activation. Included by
// lora_mma.cu (Args, TileRows, read_tile, RunMeta, read_run_meta, release_v).
//
// Why: at a prefill the two expands each read and write a [T, inter] output (at 4096 rows and
// inter 14336, 235 MB each) that the model's own SiLU and product then read and write again. Here
// g and u are read once and h written once, the bytes of the fused activation alone: the deltas
// cost their MMAs and B, which stays in L2.
//
// A block takes one tile of 64 positions (every position below slot_indptr[S], slot 0 included) and
// one column group (cpb blocks of 64 columns); warp w owns rows [16 w, 16 w + 16). g's and u's tiles
// (64 rows x 64 columns each, whole 128-byte lines of 16-bit elements, 16-byte pieces swizzled so
// both the fragment reads and the row reads are free of bank conflicts) come through a ring of
// STAGES cp.async stages, filled STAGES - 1 column blocks ahead. v * scaling is read once per block
// into registers as MMA fragments (both slices, KS k-steps of 16 ranks each: the smallest of 1, 2,
// 4 covering the pool's rank width); B fragments come straight from global memory (L2: a step's B
// is a few MB), ranks permuted inside each k-step as the v fragments are (common.cuh), one 8-byte
// load per n-tile, slice and k-step, a pass of 4 n-tiles loaded together (at rank width 16, by a
// warp whose rows meet one run, a pass ahead); ranks at or past a run's rank are selected to zero
// (the pool's rows past an adapter's rank may hold anything). A tile of several runs masks each
// run's rows into its own MMAs. Each warp adds its sums to its rows of the g and u tiles (fp32),
// writes silu(g) * u over its rows of the g tile, rounded once, and then those rows of h to global
// memory in 16-byte pieces: h may be g itself (a block writes only what it has read). The last
// column group of a tile to finish zeroes the tile's v, as every expand does. Shared memory: 3
// stages of two 8 KB tiles, 48 KB (4 blocks a multiprocessor). 16-bit types only; rows and inter in
// multiples of 8 elements, g, u and h 16-byte aligned (the host checks). Chosen by the attachment
// for gated MLPs of silu (integrations/attach.py) at steps of Attachment.glu_rows rows or more.
#pragma once

namespace lora {

template <typename T>
struct Glu {
  static_assert(sizeof(T) == 2, "lora_expand_glu serves 16-bit types");
  using M = typename Op<T>::type;
  static constexpr int BM = 64, BN = 64, STAGES = 3, CH = 16 / sizeof(T);
  // unpadded rows, 16-byte pieces swizzled (piece c of row r at c ^ (r & 7)): a warp's 4-byte
  // fragment reads and its 16-byte row reads fall in distinct banks, and 4 blocks fit a
  // multiprocessor (a padded tile left room for 3)
  static constexpr int TILE = BM * BN * (int)sizeof(T);
  static constexpr int SMEM = STAGES * 2 * TILE;
  // the tile element (row, col) (col a multiple of 2 here: one 4-byte word)
  static __device__ __forceinline__ int at(int row, int col) { return row * BN + ((((col >> 3) ^ row) & 7) << 3) + (col & 7); }
};

__device__ __forceinline__ float silu(float z) { return __fdividef(z, 1.f + __expf(-z)); }

// Ranks [k0, k0 + 4) of one B row as a fragment, those at or past r zero.
__device__ __forceinline__ void b_frag_masked(unsigned (&b)[2], uint2 q, int k0, int r) {
  const int n = r - k0;
  b[0] = n >= 2 ? q.x : n == 1 ? q.x & 0x0000ffffu : 0u;
  b[1] = n >= 4 ? q.y : n == 3 ? q.y & 0x0000ffffu : 0u;
}

template <typename T, int KS>
__device__ void expand_glu_task(const Args<T>& g, const T* __restrict__ up, T* h, int ld, int ld_h, int inter,
                                char* dsmem, int* s_indptr, TileRows<64>& tr, int u) {
  using C = Glu<T>;
  using M = typename C::M;
  constexpr int BM = C::BM, BN = C::BN, CH = C::CH, STAGES = C::STAGES, YCPR = BN / CH;
  constexpr int YPT = BM * YCPR / THREADS, YROWS = THREADS / YCPR, HALF = 4;  // n-tiles a pass
  __shared__ RunMeta<BM> rm;
  __shared__ int tall[BM];  // every position's token row (slot 0 included), -1 past the step
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int groups = g.col_groups(), cg = u % groups, tile = u / groups, p0 = tile * BM;
  const bool plain = g.slot_indptr == nullptr;
  int pend;
  if (plain) {
    if (tid < BM) tall[tid] = p0 + tid < g.positions ? p0 + tid : -1;
    if (tid == 0) tr.nrun = 0;
    __syncthreads();
    pend = g.positions;
  } else {
    read_tile<BM>(tr, s_indptr, g.slot_indptr, g.token_order, g.num_slots, g.positions, p0);
    pend = min(tr.pend, g.positions);
    if (tid < BM) tall[tid] = p0 + tid < pend ? g.token_order[p0 + tid] : -1;
    if (tr.nrun > 0) read_run_meta<T, BM>(g, tr, rm);  // ends in a barrier
    __syncthreads();
  }
  if (p0 >= pend) return;
  const int nrun = tr.nrun;
  const int cb0 = cg * g.cpb, cb1 = min(cb0 + g.cpb, g.col_blocks);
  if (cb0 >= cb1) {  // no columns for this group (the grid rounds up): it still counts as v's reader
    if (nrun > 0) release_v<T, BM>(g, tr, rm, tile, groups, p0, g.n_slices);
    return;
  }

  // each thread's share of a g (and u) tile: rows yr0 + k * YROWS, one 16-byte piece at column ycol
  const int ycol = (tid % YCPR) * CH, yr0 = tid / YCPR;
  const int ysw = C::at(yr0, ycol);  // its swizzled place (rows yr0 + k * YROWS share the swizzle)
  size_t yoff[YPT];
  bool yok[YPT];
#pragma unroll
  for (int k = 0; k < YPT; ++k) {
    const int t = tall[yr0 + k * YROWS];
    yok[k] = t >= 0;
    yoff[k] = (size_t)max(t, 0) * ld + ycol;
  }
  auto g_tile = [&](int st) { return reinterpret_cast<T*>(dsmem + st * 2 * C::TILE); };
  auto u_tile = [&](int st) { return reinterpret_cast<T*>(dsmem + (st * 2 + 1) * C::TILE); };
  auto load = [&](int cb, int st) {
    if (cb < cb1 && cb * BN + ycol < inter) {
      T* sg = g_tile(st) + ysw;
      T* su = u_tile(st) + ysw;
#pragma unroll
      for (int k = 0; k < YPT; ++k)
        if (yok[k]) {
          cp_async16(sg + k * YROWS * BN, g.y + yoff[k] + cb * BN, 16);
          cp_async16(su + k * YROWS * BN, up + yoff[k] + cb * BN, 16);
        }
    }
    cp_async_commit();
  };

  // this warp's rows and their v fragments, both slices, each row times its run's scaling (zero for
  // rows of slot 0); ranks past a row's rank meet zero B
  const int m0 = warp * 16, row0 = m0 + gq, row1 = row0 + 8;
  const bool ad0 = nrun > 0 && tr.tok[row0] >= 0, ad1 = nrun > 0 && tr.tok[row1] >= 0;
  Frags<M, false, float> vreg[2][KS];
  int kmax[2] = {0, 0};  // the largest rank of each slice among the runs meeting this warp's rows
  for (int k = 0; k < nrun; ++k)
    if (tr.run_lo[k] < m0 + 16 && tr.run_hi[k] > m0) {
      kmax[0] = max(kmax[0], rm.pr[0][k]);
      kmax[1] = max(kmax[1], rm.pr[1][k]);
    }
  {
    const size_t stride = (size_t)g.n_slices * g.rw;
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float* base = g.ws + ((size_t)p0 * g.n_slices + j) * g.rw + 4 * tq;
      const float sc0 = ad0 ? rm.ps[j][tr.run_of[row0]] : 0.f, sc1 = ad1 ? rm.ps[j][tr.run_of[row1]] : 0.f;
#pragma unroll
      for (int q = 0; q < KS; ++q) {
        const bool live = q * 16 < kmax[j];
        const float4 f0 = live && ad0 ? *reinterpret_cast<const float4*>(base + q * 16 + row0 * stride) : z;
        const float4 f1 = live && ad1 ? *reinterpret_cast<const float4*>(base + q * 16 + row1 * stride) : z;
        pack_scaled<M, false>(f0.x, f0.y, sc0, vreg[j][q].a[0], vreg[j][q].al[0]);
        pack_scaled<M, false>(f1.x, f1.y, sc1, vreg[j][q].a[1], vreg[j][q].al[1]);
        pack_scaled<M, false>(f0.z, f0.w, sc0, vreg[j][q].a[2], vreg[j][q].al[2]);
        pack_scaled<M, false>(f1.z, f1.w, sc1, vreg[j][q].a[3], vreg[j][q].al[3]);
      }
    }
  }
  const bool any_run = kmax[0] > 0 || kmax[1] > 0;  // warp-uniform: this warp's rows have a delta
  const bool live0 = tall[row0] >= 0, live1 = tall[row1] >= 0;
  // A warp whose rows meet one run (a prefill's, but where a request ends) at rank width 16 loads
  // its B fragments a pass ahead, so the round trip to L2 overlaps the pass before; its other rows
  // are slot 0's, whose v fragments are zero: no row mask. Other warps load them at each pass.
  int kw = -1, nmeet = 0;
  for (int k = 0; k < nrun; ++k)
    if (tr.run_lo[k] < m0 + 16 && tr.run_hi[k] > m0) {
      kw = k;
      ++nmeet;
    }
  const bool ahead = KS == 1 && nmeet == 1 && any_run;  // warp-uniform
  const T* bw = ahead ? g.B + (size_t)tr.run_slot[kw] * g.b_slot : g.B;
  const int rw[2] = {ahead ? rm.pr[0][kw] : 0, ahead ? rm.pr[1][kw] : 0};
  uint2 bnext[HALF][2];
  auto load_pass = [&](int cb, int pass) {  // the fragments of (column block cb, pass) into bnext
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
      const int col = cb * BN + (pass * HALF + i) * 8 + gq;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        bnext[i][j] = make_uint2(0u, 0u);
        if (cb < cb1 && col < inter && 4 * tq < rw[j])
          bnext[i][j] = __ldg(reinterpret_cast<const uint2*>(bw + g.b_at(rm.s_off[j] + col, 4 * tq)));
      }
    }
  };
  if (ahead) load_pass(cb0, 0);

  // one column block: per pass of HALF n-tiles, both slices' sums (B fragments of the pass loaded
  // together, one round trip to L2 a k-step), then h into g's tile; then the warp's 16 rows of h
  // to global memory, 16 bytes a lane
  auto compute = [&](int cb, int st) {
    T* sg = g_tile(st);
    const T* su = u_tile(st);
    const int c0 = cb * BN;
#pragma unroll
    for (int pass = 0; pass < BN / 8 / HALF; ++pass) {
      float acc[HALF][2][4];
#pragma unroll
      for (int i = 0; i < HALF; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
      if (ahead) {
        uint2 bq[HALF][2];
#pragma unroll
        for (int i = 0; i < HALF; ++i) bq[i][0] = bnext[i][0], bq[i][1] = bnext[i][1];
        if (pass == 0)
          load_pass(cb, 1);
        else
          load_pass(cb + 1, 0);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if (rw[j] == 0) continue;  // warp-uniform
#pragma unroll
          for (int i = 0; i < HALF; ++i) {
            Frags<M, false, T> fb;
            b_frag_masked(fb.b, bq[i][j], 4 * tq, rw[j]);
            mma_frags<M, false, false>(acc[i][j], vreg[j][0], fb);
          }
        }
      } else if (any_run) {
        for (int k = 0; k < nrun; ++k) {
          const int lo = tr.run_lo[k], hi = tr.run_hi[k];
          if (!(lo < m0 + 16 && hi > m0)) continue;  // warp-uniform
          const bool in0 = row0 >= lo && row0 < hi, in1 = row1 >= lo && row1 < hi;
          const T* bs = g.B + (size_t)tr.run_slot[k] * g.b_slot;
          const int r[2] = {rm.pr[0][k], rm.pr[1][k]};
#pragma unroll
          for (int q = 0; q < KS; ++q) {
            if (q * 16 >= max(r[0], r[1])) break;  // warp-uniform
            const int k0 = q * 16 + 4 * tq;
            uint2 bq[HALF][2];
#pragma unroll
            for (int i = 0; i < HALF; ++i) {
              const int col = c0 + (pass * HALF + i) * 8 + gq;  // this lane's B row (column of h)
#pragma unroll
              for (int j = 0; j < 2; ++j) {
                bq[i][j] = make_uint2(0u, 0u);
                if (col < inter && k0 < r[j])
                  bq[i][j] = __ldg(reinterpret_cast<const uint2*>(bs + g.b_at(rm.s_off[j] + col, k0)));
              }
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              if (q * 16 >= r[j]) continue;  // warp-uniform
              Frags<M, false, float> fa = vreg[j][q];
              if (!in0) fa.a[0] = fa.a[2] = 0u;
              if (!in1) fa.a[1] = fa.a[3] = 0u;
#pragma unroll
              for (int i = 0; i < HALF; ++i) {
                Frags<M, false, T> fb;
                b_frag_masked(fb.b, bq[i][j], k0, r[j]);
                mma_frags<M, false, false>(acc[i][j], fa, fb);
              }
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < HALF; ++i) {
        const int sc = (pass * HALF + i) * 8 + 2 * tq;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          if (!(hh ? live1 : live0)) continue;
          const int e = C::at(hh ? row1 : row0, sc);
          const float2 gv = unpack2<T>(*reinterpret_cast<const unsigned*>(sg + e));
          const float2 uv = unpack2<T>(*reinterpret_cast<const unsigned*>(su + e));
          const float a = gv.x + acc[i][0][2 * hh], b = gv.y + acc[i][0][2 * hh + 1];
          const float ua = uv.x + acc[i][1][2 * hh], ub = uv.y + acc[i][1][2 * hh + 1];
          *reinterpret_cast<unsigned*>(sg + e) = pack2<T>(silu(a) * ua, silu(b) * ub);
        }
      }
    }
    __syncwarp();
#pragma unroll
    for (int c = lane; c < 16 * YCPR; c += 32) {
      const int row = m0 + c / YCPR, col = (c % YCPR) * CH, t = tall[row];
      if (t >= 0 && c0 + col < inter)
        *reinterpret_cast<uint4*>(h + (size_t)t * ld_h + c0 + col) = *reinterpret_cast<const uint4*>(sg + C::at(row, col));
    }
  };

#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) load(cb0 + st, st);
  for (int cb = cb0, f = 0; cb < cb1; ++cb, ++f) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // column block cb's stage has landed for every thread; stage f - 1 is free
    load(cb + STAGES - 1, (f + STAGES - 1) % STAGES);
    compute(cb, f % STAGES);
  }
  cp_async_wait<0>();
  if (nrun > 0) release_v<T, BM>(g, tr, rm, tile, groups, p0, g.n_slices);
}

}  // namespace lora
