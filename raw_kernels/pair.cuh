// lora_pair: the delta of a decode step (2 to PAIR_TO positions, the 16-bit types, rank width RW: 16,
// or 64 for one or two slices) as
// two light launches built to overlap under programmatic dependent launch, where lora_one in chunks
// (the default it replaced, since deleted) ran each call as one launch of clusters whose setup,
// shrink, cluster sum and expand ran in series. Included by lora_mma.cu (it uses Args from there).
//
// Why: in a decoder layer's four calls back to back, a lora_one call in chunks (168 registers, 3
// blocks a multiprocessor) could not be resident beside the call before it, so every call paid its
// setup and its first loads after the one before had drained. These two kernels are light (64-110
// registers, no clusters), each lets the next grid launch as soon as it starts, and each reads what
// the grid before cannot have written (the step's addressing and the weights) before it waits for
// it: a call's setup and its loads of A and B overlap the call before (NOTES.md, "lora_pair").
//
// Algebra (chunk c: up to PAIR_M positions of one slot s, rows t_i = token_order[start_c + i]; slice
// j with columns [lo_j, hi_j) and rank r_j = min(ranks[s, j], rw), rw <= RW):
//   lora_pair_shrink, item (c, q):  V[c, i, j, r] += x[t_i, K_q] . A[s, j, r, K_q]   (fp32, r < r_j)
//   lora_pair_expand, item (c, h):  v[i, j, r] = scaling[s, j] * V[c, i, j, r]
//                                   y[t_i, col] += v[i, j, :r_j] . B[s, col, :r_j]   (col in share h)
// V is the launch's workspace (ws: chunks x PAIR_M x n * RW floats, zero before and after): each split
// adds its sums into its chunk's V with 16-byte reductions at L2, each of the chunk's expand blocks
// reads it once (one load round, where the splits' parts written whole took a round, a block barrier
// and a sum in shared memory), counts its reads done (counters[c]), and the chunk's last reader
// zeroes V[c] and its count at its end (NOTES.md, "lora_pair's v by reduction"). Rows of A and ranks
// of B past r_j are zeroed in registers (they may hold NaN). y keeps its bits where the delta is
// exactly zero; nothing is written for slot 0 (no adapter).
// Grids: the shrink `bound x splits` blocks of 4 warps (bound: the most chunks a step of `bucket`
// positions can have), an item a block, `splits` ranges of 32-wide k-blocks, each warp KB of them in
// registers (the rows of A in NS * RW / 16 row tiles of 16); the expand's blocks of 8 warps share the
// chunks' column tiles (16 columns of one slice, RW / 16 MMA k-steps) out, U tiles a warp in flight
// (4 at RW = 16, 2 at 64), whole tiles (every Llama-shaped tile) on straight loads of B and
// reductions of y's pairs at L2; where every tile of a share is whole (ALIGNED, RW = 16), its tiles
// of each slice in a loop of their own (pair_expand_run: no slice walk or per-tile test). Blocks
// past the step's items leave at once, but for block 0, which waits for the grid before.
// Order of a block: let the next grid launch; where EARLY_READS, the addressing, the chunk, the ranks
// and the first loads of weights (A; B) in one round after slot_indptr's, x and y sent towards L2,
// then wait for the grid before; then x (the shrink), or V (the expand), whose deltas are added into y
// at L2 (pair_red) with no read of y where a tile is whole. The expand waits for its shrink, so y is
// touched only after the call before has finished with it. V and the counts are
// touched by the next call only after its shrink's wait, and every kernel of the family keeps one block
// waiting for the grid before it (lora_one and lora_chunk too where they find no work), so no grid
// finishes before the one before it: the next shrink's wait returns only once this expand has
// finished.
// Shapes: any in, out, slices up to 8 (the shrink built for NS slices: 1, 2, 3, 4 or 8 at RW = 16; 1 or
// 2 at RW = 64), ranks up to RW below the pool's max_rank, any slots; ALIGNED (flags == 7) takes x, A
// and B in 16- and 8-byte pieces, the other instantiation reads the flags and goes element by element
// where they say so; y by 4-byte reductions at L2 where a tile is whole and y's rows allow it, else
// loaded, summed and stored an element at a time.
#pragma once

namespace lora {

constexpr int PAIR_M = 8;   // positions a chunk: the n of an m16n8k16 MMA
constexpr int PAIR_SW = 4;  // warps of a shrink block
constexpr int PAIR_EW = 8;  // warps of an expand block

// 32-wide k-blocks a warp of the shrink holds in registers for RT row tiles of 16 ranks (two 16-byte
// pieces of A a row tile and one of x each): at most 16 pieces of A.
template <int RT>
struct PairKB {
  static constexpr int KB = RT == 1 ? 4 : RT == 2 ? 3 : RT <= 4 ? 2 : 1;
};
// Column tiles a warp of the expand has in flight at rank width RW (a tile's B is RW / 2 registers a lane).
template <int RW>
struct PairU {
  static constexpr int U = RW == 16 ? 4 : 2;
};

struct PairChunk {
  int slot, start, m;
};

// The chunks of slots 1..S-1 (ceil(count / PAIR_M) each): sip[0..S] = slot_indptr, cpre[s] = chunks of
// the slots before s, cpre[S] = all of them, which it returns. Warp 0 scans, 32 slots a pass; thread 32
// runs `side` once what the block loaded with slot_indptr is in shared memory.
template <typename Side>
__device__ __forceinline__ int pair_scan(const int* __restrict__ indptr, int S, int* sip, int* cpre, Side side) {
  for (int s = threadIdx.x; s <= S; s += blockDim.x) sip[s] = indptr[s];
  __syncthreads();
  if (threadIdx.x == 32) side();  // what else the block needs from the first round (warp 1, beside the scan)
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int run = 0;
    for (int base = 1; base < S; base += 32) {
      const int s = base + lane;
      const int ch = s < S ? (sip[s + 1] - sip[s] + PAIR_M - 1) / PAIR_M : 0;
      int v = ch;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
      }
      if (s < S) cpre[s] = run + v - ch;
      run += __shfl_sync(0xffffffffu, v, 31);
    }
    if (lane == 0) cpre[S] = run;
  }
  __syncthreads();
  return cpre[S];
}

// Chunk c (< the scan's count): its slot, first index into token_order and positions.
__device__ __forceinline__ PairChunk pair_find(const int* sip, const int* cpre, int S, int c) {
  int lo = 1, hi = S;  // cpre[lo] <= c < cpre[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (cpre[mid] <= c) lo = mid; else hi = mid;
  }
  PairChunk r;
  r.slot = lo;
  r.start = sip[lo] + PAIR_M * (c - cpre[lo]);
  r.m = min(PAIR_M, sip[lo + 1] - r.start);
  return r;
}

// Slice j's column offset (out_offsets is not passed for one slice).
template <typename T>
__device__ __forceinline__ int pair_offset(const Args<T>& g, int j) {
  return g.n_slices > 1 ? g.out_offsets[j] : (j == 0 ? 0 : g.out_features);
}

// 8 consecutive elements of T from p as an MMA's 16 bytes, those from `valid` on zero (never read):
// one 16-byte load where `vec` (p aligned) and the piece is whole.
template <typename T, bool ALIGNED>
__device__ __forceinline__ uint4 pair_load8(const T* p, int valid, bool vec) {
  if (valid <= 0) return make_uint4(0u, 0u, 0u, 0u);
  if constexpr (ALIGNED) {
    return *reinterpret_cast<const uint4*>(p);
  } else {
    if (vec && valid >= 8) return *reinterpret_cast<const uint4*>(p);
    T e[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = i < valid ? p[i] : from_float<T>(0.f);
    return *reinterpret_cast<const uint4*>(e);
  }
}

// 4 consecutive elements (ranks) of T from p, those from `valid` on zero (past a rank B may hold NaN).
template <typename T, bool ALIGNED>
__device__ __forceinline__ uint2 pair_load4(const T* p, int valid, bool vec) {
  if (valid <= 0) return make_uint2(0u, 0u);
  if (ALIGNED || vec) {
    uint2 u = *reinterpret_cast<const uint2*>(p);
    if (valid < 4) {
      u.y = valid <= 2 ? 0u : (valid == 3 ? (u.y & 0xffffu) : u.y);
      u.x = valid == 1 ? (u.x & 0xffffu) : u.x;
    }
    return u;
  }
  if constexpr (!ALIGNED) {
    T e[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) e[i] = i < valid ? p[i] : from_float<T>(0.f);
    return *reinterpret_cast<const uint2*>(e);
  }
  return make_uint2(0u, 0u);
}

// ---- the shrink ------------------------------------------------------------------------------------
// Block `item` = (chunk c, split q): k-blocks [q * SW * KB, (q + 1) * SW * KB) of 32 features, warp w
// the KB from q * SW * KB + w * KB, A's loaded before the wait; where `in` is longer than
// PAIR_MAX_SPLITS such splits cover, split q's share of the k-blocks, a warp one in turn (after the
// wait). Lane 4 g + t holds, per k-block, 16 bytes of x (position g, features 8 t .. 8 t + 7) and of
// A (rows g and g + 8 of each row tile): features are permuted inside each k-block, the MMA's logical
// k {2t, 2t+1, 2t+8, 2t+9} of the first k-step being features 8t..8t+3 and of the second 8t+4..8t+7
// (the same permutation in A and x, so the sum is the same).
template <typename T, int NS, int RW, bool ALIGNED>
__device__ void pair_shrink(const Args<T>& g, int* dsm) {
  constexpr int Q = RW / 16, RT = NS * Q, KB = PairKB<RT>::KB, W = RT * 16;  // row tile rt: slice rt / Q
  __shared__ __align__(16) float red[PAIR_SW][PAIR_M][W];
  const int S = g.num_slots, n = g.n_slices, in = g.in_features, R = g.max_rank, splits = g.splits;
  const bool early = g.flags & EARLY_READS;
  release_next_grid();
  if (!early) wait_prior_grid();
  int* sip = dsm;
  int* cpre = dsm + S + 1;
  const int chunks = pair_scan(g.slot_indptr, S, sip, cpre, [] {});
  const int item = blockIdx.x;
  if (item >= chunks * splits) {  // no item: leave, block 0 only once the grid before has finished
    if (early && item == 0) wait_prior_grid();
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
  const PairChunk ch = pair_find(sip, cpre, S, item / splits);
  const int q = item % splits, kbs = (in + 31) / 32, cap = g.rank_cap();
  const bool vec = ALIGNED || (g.flags & 1);
  const T* as = g.A + (size_t)ch.slot * n * R * in;
  int rk[NS];  // loaded beside A (whose loads do not wait on them); rows past r_j are zeroed after
#pragma unroll
  for (int j = 0; j < NS; ++j) rk[j] = j < n ? g.ranks[ch.slot * n + j] : 0;
  const int row = gq < ch.m ? g.token_order[ch.start + gq] : -1;
  const T* xr = g.x + (size_t)max(row, 0) * in;
  const int rows = min(R, RW);
  // A's 16 bytes of row tile rt (slice rt / Q, ranks 16 (rt % Q) ..), row gq + 8 h, at k-block kb (zero
  // past `in` and past R's rows)
  auto a_piece = [&](int rt, int h, int kb) {
    const int j = rt / Q, r = 16 * (rt % Q) + gq + 8 * h, k = kb * 32 + 8 * t;
    return pair_load8<T, ALIGNED>(as + ((size_t)j * R + r) * in + k, j < n && r < rows ? in - k : 0, vec);
  };
  auto live = [&](int rt, int h) { return 16 * (rt % Q) + gq + 8 * h < min(rk[rt / Q], cap); };  // below r_j
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  auto mma2 = [&](float (&dd)[4], const uint4& lo, const uint4& hi, const uint4& xv) {  // two k-steps
    const unsigned a0[4] = {lo.x, hi.x, lo.y, hi.y}, b0[2] = {xv.x, xv.y};
    mma16816<T>(dd, a0, b0);
    const unsigned a1[4] = {lo.z, hi.z, lo.w, hi.w}, b1[2] = {xv.z, xv.w};
    mma16816<T>(dd, a1, b1);
  };
  float d[RT][4] = {};
  if (splits * PAIR_SW * KB >= kbs) {  // the host's plan: a round of KB k-blocks a warp covers the split
    const int kb0 = (q * PAIR_SW + warp) * KB;
    uint4 a[KB][RT][2];
#pragma unroll
    for (int i = 0; i < KB; ++i)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) a[i][rt][h] = a_piece(rt, h, kb0 + i);
    if (row >= 0 && t == 0)  // x's k-blocks towards L2 before the wait
#pragma unroll
      for (int i = 0; i < KB; ++i)
        if ((kb0 + i) * 32 < in) prefetch_l2(xr + (kb0 + i) * 32);
    if (early) wait_prior_grid();
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)  // past r_j A may hold anything (NaN): those rows count as zero
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (!live(rt, h))
#pragma unroll
          for (int i = 0; i < KB; ++i) a[i][rt][h] = zero;
#pragma unroll
    for (int i = 0; i < KB; ++i) {
      const int k = (kb0 + i) * 32 + 8 * t;
      const uint4 xv = pair_load8<T, ALIGNED>(xr + k, row >= 0 ? in - k : 0, vec);
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) mma2(d[rt], a[i][rt][0], a[i][rt][1], xv);
    }
  } else {  // `in` longer than PAIR_MAX_SPLITS such rounds: the split's k-blocks a warp in turn
    if (early) wait_prior_grid();
    const int per = (kbs + splits - 1) / splits, kz = min(kbs, (q + 1) * per);
    for (int kb = q * per + warp; kb < kz; kb += PAIR_SW) {
      const int k = kb * 32 + 8 * t;
      const uint4 xv = pair_load8<T, ALIGNED>(xr + k, row >= 0 ? in - k : 0, vec);
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
        mma2(d[rt], live(rt, 0) ? a_piece(rt, 0, kb) : zero, live(rt, 1) ? a_piece(rt, 1, kb) : zero, xv);
    }
  }
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {  // D: rows (ranks) g and g + 8, columns (positions) 2t and 2t + 1
    red[warp][2 * t][rt * 16 + gq] = d[rt][0];
    red[warp][2 * t + 1][rt * 16 + gq] = d[rt][1];
    red[warp][2 * t][rt * 16 + gq + 8] = d[rt][2];
    red[warp][2 * t + 1][rt * 16 + gq + 8] = d[rt][3];
  }
  __syncthreads();
  const int Wn = n * RW;  // v's rows are n slices wide
  float* vc = g.ws + (size_t)(item / splits) * PAIR_M * Wn;  // the chunk's v: every split adds into it
  for (int f = threadIdx.x; f < ch.m * Wn / 4; f += blockDim.x) {
    const int e = 4 * f, i = e / Wn, r = e % Wn;
    float4 s = *reinterpret_cast<const float4*>(&red[0][i][r]);
#pragma unroll
    for (int w = 1; w < PAIR_SW; ++w) {
      const float4 u = *reinterpret_cast<const float4*>(&red[w][i][r]);
      s.x += u.x;
      s.y += u.y;
      s.z += u.z;
      s.w += u.w;
    }
    red_add4(vc + e, s);
  }
}

// ---- the expand ------------------------------------------------------------------------------------
// y's pair (a, b) += (da, db) as one 32-bit word: an element whose delta is exactly zero keeps its bits.
template <typename T>
__device__ __forceinline__ unsigned pair_add(unsigned yv, float da, float db) {
  const float2 f = unpack2<T>(yv);
  const unsigned s = pack2<T>(f.x + da, f.y + db);
  return (da == 0.f ? (yv & 0xffffu) : (s & 0xffffu)) | (db == 0.f ? (yv & 0xffff0000u) : (s & 0xffff0000u));
}

// y's pair at p (4-byte aligned) += (da, db), a pair whose deltas are both exactly zero untouched. Where
// RED_Y (sm_90, and the host check's emulation) one packed reduction at L2 (red_add_pair): the warp loads
// no y, so no round of its tiles waits for y's lines, and the add lands where the line is; a zero delta
// beside a nonzero one adds -0, which keeps every bit of y (pack_delta2). The delta is rounded to T before
// the add (the load's path rounded the sum once). Before sm_90 a load and a store: a pair has one writer.
template <typename T>
__device__ __forceinline__ void pair_red(T* p, float da, float db) {
  if (da == 0.f && db == 0.f) return;
  if constexpr (RED_Y) {
    red_add_pair(p, pack_delta2<T>(da, db));
  } else {
    unsigned* q = reinterpret_cast<unsigned*>(p);
    *q = pair_add<T>(*q, da, db);
  }
}

// pair_expand's rounds over a run [t0, t1) of whole tiles of one slice at rank width 16, ALIGNED
// (c0: the run's first column; vrow: the slice's v of the lane's position gq; rk: its rank): where
// `first` (the run starts the share), the first round's B already in bw (loaded before the wait as
// every share's is; that of tiles past t1, the next slice's, left unused), then rounds of U tiles a
// warp, tile w + EW u at column c0 + 16 (w + EW u). B masked past rk as the general loop masks it; the
// deltas added into y's pairs at L2 where a position is present (pair_red: zero deltas keep y's bits).
template <typename T, int U>
__device__ __forceinline__ void pair_expand_run(const Args<T>& g, const T* vrow, int rk, const T* bs, T* const* yr,
                                                uint2 (&bw)[U][2][1], int c0, int t0, int t1, bool first) {
  constexpr int EW = PAIR_EW;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3, R = g.max_rank;
  const uint2 v = *reinterpret_cast<const uint2*>(vrow + 4 * t);
  const unsigned bv[2] = {v.x, v.y};
  const int valid = rk - 4 * t;  // ranks 4t .. 4t + 3 of B: those below rk kept
  const unsigned mx = valid <= 0 ? 0u : (valid == 1 ? 0xffffu : ~0u);
  const unsigned my = valid <= 2 ? 0u : (valid == 3 ? 0xffffu : ~0u);
  const bool bon = 4 * t < R;  // ranks past R (a pool of max_rank below 16) are never read
  const int cw = c0 + 16 * warp + 2 * gq;  // the lane's first column in the warp's first tile
  for (int base = t0 + warp; base < t1; base += EW * U) {
    const int cb = cw + 16 * (base - t0 - warp);
    if (!first || base != t0 + warp) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (base + EW * u >= t1) break;
        const int c = cb + 16 * EW * u;
        const T* p = bs + g.b_at(c, 4 * t);
#pragma unroll
        for (int e = 0; e < 2; ++e)
          bw[u][e][0] = bon ? *reinterpret_cast<const uint2*>(p + e * g.b_ld) : make_uint2(0u, 0u);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + EW * u >= t1) break;
      const int c = cb + 16 * EW * u;
      float d[4] = {};
      const unsigned a[4] = {bw[u][0][0].x & mx, bw[u][1][0].x & mx, bw[u][0][0].y & my, bw[u][1][0].y & my};
      mma16816<T>(d, a, bv);
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (yr[e]) pair_red<T>(yr[e] + c, d[e], d[2 + e]);
    }
  }
}

// The chunk's tiles: 16 columns of one slice from the slice's first column (a slice of rank 0 too: its
// delta is zero, so y keeps its bits).
// Item (chunk c, share h of the chunk's tiles): tile w + 8 u of the share to warp w. The MMA gives
// D[16 columns][8 positions] = B[s, columns, ranks] . v[positions, ranks]^T, B's rows its A operand,
// rows permuted so that lane 4 g + t holds columns c0 + 2g and c0 + 2g + 1 at positions 2t and 2t + 1
// (y as two 32-bit pairs), ranks permuted so that a lane's B is Q 8-byte pieces a column (4 Q ranks
// from 4 Q t) and its v one 8-byte piece a k-step (logical k {2t, 2t+1, 2t+8, 2t+9} of k-step b =
// ranks 4 Q t + 4 b .. 4 Q t + 4 b + 3).
template <typename T, int RW, bool ALIGNED>
__device__ void pair_expand(const Args<T>& g, int* dsm) {
  constexpr int EW = PAIR_EW, U = PairU<RW>::U, Q = RW / 16;  // Q k-steps of 16 ranks a tile
  __shared__ __align__(16) T vs[PAIR_M][8 * 16];  // n * RW <= 128 (the host's plan)
  __shared__ int off[9], tpre[9], rks[8];
  const int S = g.num_slots, n = g.n_slices, R = g.max_rank, out = g.out_features;
  const bool early = g.flags & EARLY_READS;
  release_next_grid();
  if (!early) wait_prior_grid();
  int* sip = dsm;
  int* cpre = dsm + S + 1;
  if (threadIdx.x <= n) off[threadIdx.x] = pair_offset(g, threadIdx.x);
  const int chunks = pair_scan(g.slot_indptr, S, sip, cpre, [&] {  // the tiles before each slice
    int run = 0;
    for (int j = 0; j < n; ++j) {
      tpre[j] = run;
      run += (off[j + 1] - off[j] + 15) >> 4;
    }
    tpre[n] = run;
  });
  const int shares = max(1, (int)gridDim.x / max(chunks, 1)), item = blockIdx.x;
  if (item >= chunks * shares) {  // (the host's grid holds every chunk: at least `bound` blocks)
    if (early && item == 0) wait_prior_grid();
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
  const PairChunk ch = pair_find(sip, cpre, S, item / shares);
  if (threadIdx.x < n)  // the slot's ranks, read after v's barrier below
    rks[threadIdx.x] = min(g.ranks[ch.slot * n + threadIdx.x], g.rank_cap());
  const int tiles = tpre[n], h = item % shares, per = (tiles + shares - 1) / shares;
  const int t0 = min(tiles, h * per), t1 = min(tiles, t0 + per);
  const bool bvec = ALIGNED || (g.flags & 2), yvec = ALIGNED || (g.flags & 4);
  const T* bs = g.B + (size_t)ch.slot * g.b_slot;
  // A warp's tiles of a round: t0 + warp + EW u; their slice (found by walking on from the last one:
  // tiles rise), first column, and whether the tile is whole (16 columns inside its slice, an even
  // first column, y on its 4-byte pairs): a whole tile takes straight loads of B and adds y's pairs
  // at L2 (pair_red).
  int sj = 0;
  int pj[U], pc[U];
  bool pw[U];
  auto place = [&](int u, int tile) {
    while (sj + 1 < n && tile >= tpre[sj + 1]) ++sj;
    pj[u] = sj;
    pc[u] = off[sj] + 16 * (tile - tpre[sj]);
    pw[u] = yvec && !(pc[u] & 1) && pc[u] + 16 <= off[sj + 1];
  };
  // B: [tile][column c0 + 2g, c0 + 2g + 1][k-step b], ranks 4 Q t + 4 b .. + 3 (masked past r_j where used)
  uint2 bw[U][2][Q];
  auto load_b = [&](int u) {
    const int c = pc[u] + 2 * gq;
    const T* p = bs + g.b_at(c, 4 * Q * t);  // ranks 4 Q t .. 4 Q t + 4 Q - 1: one block of 16 or inside one
    if (ALIGNED && pw[u]) {
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int b = 0; b < Q; ++b)  // (ranks past R, in a pool of max_rank below RW, are never read)
          bw[u][e][b] =
              4 * Q * t + 4 * b < R ? *reinterpret_cast<const uint2*>(p + e * g.b_ld + 4 * b) : make_uint2(0u, 0u);
    } else {
      const int hi = off[pj[u] + 1];
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int b = 0; b < Q; ++b)
          bw[u][e][b] = pair_load4<T, ALIGNED>(p + e * g.b_ld + 4 * b, c + e < hi ? R - 4 * Q * t - 4 * b : 0, bvec);
    }
  };
#pragma unroll
  for (int u = 0; u < U; ++u) {  // the first tiles' B before the wait (weights)
    const int tile = t0 + warp + EW * u;
    if (tile < t1) {
      place(u, tile);
      load_b(u);
    }
  }
  T* yr[2];  // the lane's rows of y: positions 2t and 2t + 1 (nullptr past m); read only after the wait
#pragma unroll
  for (int c = 0; c < 2; ++c) yr[c] = 2 * t + c < ch.m ? g.y + (size_t)g.token_order[ch.start + 2 * t + c] * out : nullptr;
  if (gq == 0)  // the first tiles' y towards L2 before the wait
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (t0 + warp + EW * u < t1 && yr[c]) prefetch_l2(yr[c] + pc[u]);
  if (early) wait_prior_grid();
  unsigned yv[U][2];  // y: [tile][position 2t, 2t + 1] at columns c0 + 2g, c0 + 2g + 1
  auto load_y = [&](int u) {
    const int c = pc[u] + 2 * gq;
    if (pw[u]) return;  // a whole tile adds its pairs at L2 (pair_red): no y read
    const int hi = off[pj[u] + 1];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      yv[u][e] = 0u;
      if (!yr[e] || c >= hi) continue;
      T two[2] = {yr[e][c], c + 1 < hi ? yr[e][c + 1] : from_float<T>(0.f)};
      yv[u][e] = *reinterpret_cast<const unsigned*>(two);
    }
  };
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (t0 + warp + EW * u < t1) load_y(u);
  // v of the chunk (the splits' sums, added by reduction): a thread an entry of 4 floats, read at L2,
  // scaled, rounded to T
  const int Wn = n * RW, chunk = item / shares;
  float* vc = g.ws + (size_t)chunk * PAIR_M * Wn;
  for (int f = threadIdx.x; f < PAIR_M * Wn / 4; f += blockDim.x) {
    const int e = 4 * f, i = e / Wn, r = e % Wn;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    if (i < ch.m) {  // (the scaling read in the same round)
      const float k = g.scaling[ch.slot * n + r / RW];
      s = __ldcg(reinterpret_cast<const float4*>(vc + e));
      s.x *= k;
      s.y *= k;
      s.z *= k;
      s.w *= k;
    }
    *reinterpret_cast<uint2*>(&vs[i][r]) = make_uint2(pack2<T>(s.x, s.y), pack2<T>(s.z, s.w));
  }
  __syncthreads();
  // the block's reads of v are done (their values are in vs): thread 0 counts them, and the count's
  // return is used only at warp 0's end, so no warp waits on it
  int readers = 0;
  if (threadIdx.x == 0) readers = atomicAdd(g.counters + chunk, 1);
  // at warp 0's end: the chunk's last reader zeroes its v and count for the next call (or replay)
  auto release = [&] {
    if (warp != 0 || __shfl_sync(0xffffffffu, readers, 0) != shares - 1) return;
    __threadfence();  // every other share's count (after its reads) before the zeroes
    for (int f = lane; f < ch.m * Wn / 4; f += 32)
      __stcg(reinterpret_cast<float4*>(vc + 4 * f), make_float4(0.f, 0.f, 0.f, 0.f));
    if (lane == 0) atomicExch(g.counters + chunk, 0);
  };
  if constexpr (ALIGNED && RW == 16) {
    // A share of whole tiles (every share of the Llama-shaped targets: slices of a multiple of 16
    // columns), one run a slice it touches: the slice's v and B's rank mask held from the run's first
    // tile on, each tile at a fixed stride from the one before, straight loads and reductions, no slice
    // walk or tile test. (A share that spans two slices took the general loop below before, 3-4 times
    // as long a tile, and its block ended the launch last: NOTES.md, "runs a slice".)
    int j0 = 0;
    while (j0 + 1 < n && t0 >= tpre[j0 + 1]) ++j0;
    bool whole = true;
    for (int j = j0; j < n && tpre[j] < t1; ++j)
      whole = whole && !(off[j] & 1) && 16 * (min(t1, tpre[j + 1]) - tpre[j]) <= off[j + 1] - off[j];
    if (whole) {
      for (int j = j0; j < n && tpre[j] < t1; ++j) {
        const int r0 = max(t0, tpre[j]), r1 = min(t1, tpre[j + 1]);
        pair_expand_run<T>(g, vs[gq] + j * RW, rks[j], bs, yr, bw, off[j] + 16 * (r0 - tpre[j]), r0, r1, j == j0);
      }
      release();
      return;
    }
  }
  unsigned short part = 0;  // slices whose rank is below RW: B masked past it
  for (int jj = 0; jj < n; ++jj) part |= rks[jj] < RW ? 1u << jj : 0u;
  for (int base = t0 + warp; base < t1; base += EW * U) {
    if (base != t0 + warp) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int tile = base + EW * u;
        if (tile < t1) {
          place(u, tile);
          load_b(u);
          load_y(u);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + EW * u >= t1) break;
      const int jt = pj[u], c = pc[u] + 2 * gq;
      float d[4] = {};
#pragma unroll
      for (int b = 0; b < Q; ++b) {
        const uint2 v = *reinterpret_cast<const uint2*>(&vs[gq][jt * RW + 4 * Q * t + 4 * b]);
        const unsigned bv[2] = {v.x, v.y};
        if (part >> jt & 1) {  // past r_j B may hold anything (NaN): zero there
          const int valid = rks[jt] - 4 * Q * t - 4 * b;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            bw[u][e][b].y = valid <= 2 ? 0u : (valid == 3 ? (bw[u][e][b].y & 0xffffu) : bw[u][e][b].y);
            bw[u][e][b].x = valid <= 0 ? 0u : (valid == 1 ? (bw[u][e][b].x & 0xffffu) : bw[u][e][b].x);
          }
        }
        const unsigned a[4] = {bw[u][0][b].x, bw[u][1][b].x, bw[u][0][b].y, bw[u][1][b].y};
        mma16816<T>(d, a, bv);
      }
      if (pw[u]) {  // a whole tile: each present position's pair added at L2 (zero deltas keep y's bits)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (yr[e]) pair_red<T>(yr[e] + c, d[e], d[2 + e]);
        continue;
      }
      const int hi = off[jt + 1];
      if (c >= hi) continue;
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // position 2t + e: columns c (d[e]) and c + 1 (d[2 + e])
        if (!yr[e]) continue;
        const float da = d[e], db = c + 1 < hi ? d[2 + e] : 0.f;
        if (da == 0.f && db == 0.f) continue;
        const unsigned w = pair_add<T>(yv[u][e], da, db);
        const T* two = reinterpret_cast<const T*>(&w);
        if (da != 0.f) yr[e][c] = two[0];
        if (db != 0.f) yr[e][c + 1] = two[1];
      }
    }
  }
  release();
}

}  // namespace lora
