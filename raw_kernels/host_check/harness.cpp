// The lora kernels' task functions run on the host, block after block, for checks of their logic
// (check.py builds this as a shared library and calls emu_delta, emu_glu, emu_expand_v and emu_gather_a
// through ctypes).
#include "host_cuda.h"
#include "lora_mma.cu"
#include "expand_v.cu"

namespace emu {
Fiber fibers[NTHREADS];
int nthreads = 128;
Fiber* cur = nullptr;
ucontext_t sched_ctx;
int block_arrived = 0, warp_arrived[NTHREADS / 32] = {};
EmuIdx block_idx{0u, 0u, 0u};
EmuIdx grid_dim{1u, 1u, 1u};
long long mma_count = 0;
AsyncQueue async_q[NTHREADS];
std::vector<BulkCopy> bulk_pending;
std::vector<std::pair<unsigned long long*, long long>> bulk_tx;
bool cp_early = false;
Stage stage[NTHREADS / 32];

static void yield_wait(int kind) {
  cur->wait = kind;
  swapcontext(&cur->ctx, &sched_ctx);
}
void block_barrier() {
  if (++block_arrived == nthreads) {
    block_arrived = 0;
    for (auto& f : fibers)
      if (f.wait == 1) f.wait = 0;
    return;
  }
  yield_wait(1);
}
void warp_barrier() {
  const int w = cur->tid >> 5;
  if (++warp_arrived[w] == 32) {
    warp_arrived[w] = 0;
    for (int t = 32 * w; t < 32 * w + 32; ++t)
      if (fibers[t].wait == 2) fibers[t].wait = 0;
    return;
  }
  yield_wait(2);
}

static void (*body)(int) = nullptr;
static int body_arg = 0;
static void trampoline(int tid) {
  body(body_arg);
  fibers[tid].done = true;
  swapcontext(&fibers[tid].ctx, &sched_ctx);
}

// Runs body(u) as one block of `nthreads` fibers.
static void run_block(void (*fn)(int), int u) {
  body = fn;
  body_arg = u;
  for (int t = 0; t < nthreads; ++t) {
    Fiber& f = fibers[t];
    f.tid = t;
    f.done = false;
    f.wait = 0;
    async_q[t] = AsyncQueue{};
    if (f.stack.empty()) f.stack.resize(1 << 18);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, (void (*)())trampoline, 1, t);
  }
  block_arrived = 0;
  for (int& w : warp_arrived) w = 0;
  while (true) {
    bool any = false, alldone = true;
    for (int t = 0; t < nthreads; ++t) {
      Fiber& f = fibers[t];
      if (f.done) continue;
      alldone = false;
      if (f.wait) continue;
      any = true;
      cur = &f;
      swapcontext(&sched_ctx, &f.ctx);
    }
    if (alldone) break;
    if (!any) {
      fprintf(stderr, "deadlock in block %d: barrier counts block %d warps %d %d %d %d\n", u, block_arrived,
              warp_arrived[0], warp_arrived[1], warp_arrived[2], warp_arrived[3]);
      abort();
    }
  }
}
}  // namespace emu

struct Launch {
  void *y;
  const void *x, *A, *B;
  const float* scaling;
  const int *ranks, *out_offsets, *token_order, *slot_indptr;
  float* ws;
  int* counters;
  int num_slots, n_slices, max_rank, in_features, out_features, bucket, positions, rw, splits, k_split,
      col_blocks, cpb, chunked, flags, aligned, b_slot, sliced;  // b_slot: 0 for out * R
  int b_ld = 0, b_blk = 0;  // B's column and rank-block strides (0, 0: [S, out, R], so R and 16)
};
static Launch L;
static std::vector<char> dsm(256 * 1024);
static int s_indptr[4097];

template <typename T> static lora::Args<T> args() {
  return lora::Args<T>{(T*)L.y, (const T*)L.x, (const T*)L.A, (const T*)L.B, L.scaling, L.ranks, L.out_offsets,
                       L.token_order, L.slot_indptr, L.ws, L.counters, L.num_slots, L.n_slices, L.max_rank,
                       L.in_features, L.out_features, L.bucket, L.positions, L.rw, L.splits, L.k_split,
                       L.col_blocks, L.cpb, L.flags,
                       L.b_slot ? (long long)L.b_slot : (long long)L.out_features * L.max_rank,
                       L.b_ld ? L.b_ld : L.max_rank, L.b_blk ? (long long)L.b_blk : 16LL, L.chunked};
}
template <typename T, int BM, bool AL> static void shrink_block(int u) {
  static lora::TileRows<BM> tr;
  auto g = args<T>();
  lora::shrink_task<T, BM, false, AL>(g, dsm.data(), s_indptr, tr, u, false);
}
template <typename T, int BM, int BN, bool AL> static void expand_block(int u) {
  static lora::TileRows<BM> tr;
  auto g = args<T>();
  lora::expand_task<T, BM, BN, false, AL>(g, dsm.data(), s_indptr, tr, u, false);
}
template <typename T, int BM, bool AL> static void stream_block(int u) {
  static lora::TileRows<BM> tr;
  auto g = args<T>();
  lora::expand_stream_task<T, BM, AL>(g, s_indptr, tr, u);
}

template <typename T, bool AL> static void ring_block(int u) {
  static lora::TileRows<64> tr;
  auto g = args<T>();
  lora::expand_ring_task<T, AL>(g, dsm.data(), s_indptr, tr, u);
}

// lora_chunk (chunk.cuh), where its chunks are cut into several parts: each item's shrink part in
// a first pass over the items, its expand part in a second (the kernel runs both in one block, the
// expand waiting for its chunk's parts, which here have all run), so no block waits on one that
// has not run. An item runs as a block of its own; the parts a chunk is cut into are the kernel's
// for a grid of `blocks`.
static int g_chunk_phase = 0, g_chunk_grid = 0;
template <typename T, int RW, int BM, bool AL, bool SL> static void chunk_block(int u) {
  static lora::ChunkRows<BM> tr;
  static lora::ChunkScan cs;
  static lora::ChunkWork cw;
  auto g = args<T>();
  int* s_ip = reinterpret_cast<int*>(dsm.data() + lora::Chunk<T, RW, BM>::SMEM + lora::Chunk<T, RW, BM>::SUMS);
  lora::count_chunks<BM, lora::Chunk<T, RW, BM>::NTHREADS>(cs, s_ip, g.slot_indptr, g.num_slots, g.positions);
  const int parts = lora::chunk_parts(g, cs.chunks, g_chunk_grid), c = u / parts, q = u % parts;
  if (c >= cs.chunks) return;
  lora::chunk_setup<T, RW, BM, SL>(g, s_ip, tr, cs, cw, c);
  if (g_chunk_phase == 0) lora::chunk_shrink<T, RW, BM, AL, SL>(g, dsm.data(), tr, cw, c, q, parts);
  else lora::chunk_expand<T, RW, BM, AL, SL>(g, dsm.data(), tr, cw, c, q, parts);
}
// The kernel's own block body (chunk_task: the first item by block, tickets past the grid, the done count), for a
// step whose chunks are cut into one part each: no part then waits on another block.
static int g_step_chunks = 0;
template <typename T, int RW, int BM> static void chunk_count_block(int) {
  static lora::ChunkScan cs;
  auto g = args<T>();
  lora::count_chunks<BM, lora::Chunk<T, RW, BM>::NTHREADS>(
      cs, reinterpret_cast<int*>(dsm.data() + lora::Chunk<T, RW, BM>::SMEM + lora::Chunk<T, RW, BM>::SUMS), g.slot_indptr,
      g.num_slots, g.positions);
  if (threadIdx.x == 0) g_step_chunks = cs.chunks;
}
template <typename T, int RW, int BM, bool AL, bool SL> static void chunk_task_block(int) {
  static lora::ChunkRows<BM> tr;
  static lora::ChunkScan cs;
  static lora::ChunkWork cw;
  auto g = args<T>();
  lora::chunk_task<T, RW, BM, AL, SL>(g, dsm.data(),
                                      reinterpret_cast<int*>(dsm.data() + lora::Chunk<T, RW, BM>::SMEM + lora::Chunk<T, RW, BM>::SUMS), tr, cs, cw,
                                      true);  // early: the order the backend's calls take (the wait is a no-op here)
}
template <typename T, int RW, int BM, bool AL, bool SL> static int run_chunk_rw(int blocks) {
  emu::nthreads = lora::Chunk<T, RW, BM>::NTHREADS;  // 256 in chunks of 128
  struct Restore {
    ~Restore() { emu::nthreads = 128; }
  } restore;
  emu::run_block(chunk_count_block<T, RW, BM>, 0);
  if (lora::chunk_parts(args<T>(), g_step_chunks, blocks) == 1) {  // the kernel's blocks, in order
    emu::grid_dim = EmuIdx{unsigned(blocks), 1u, 1u};
    for (int b = 0; b < blocks; ++b) {  // blocks past the step's items leave at once: blockIdx counts
      emu::block_idx = EmuIdx{unsigned(b), 0u, 0u};
      emu::run_block(chunk_task_block<T, RW, BM, AL, SL>, b);
    }
    emu::grid_dim = EmuIdx{1u, 1u, 1u};
    emu::block_idx = EmuIdx{0u, 0u, 0u};
    return 0;
  }
  g_chunk_grid = blocks;  // else every item the most chunks (units) times `splits` parts can make
  const int items = args<T>().units(BM) * L.splits;
  for (g_chunk_phase = 0; g_chunk_phase < 2; ++g_chunk_phase)
    for (int u = 0; u < items; ++u) emu::run_block(chunk_block<T, RW, BM, AL, SL>, u);
  return 0;
}
// blocks: the kernel's grid; bm: positions a chunk; SL: the instantiation for several slices
template <typename T, bool AL, bool SL> static int run_chunk_sl(int bm, int blocks) {
  if constexpr (sizeof(T) != 2) {
    return 2;
  } else {
    L.chunked = 1;
    if (L.rw <= 16)
      return bm == 16 ? run_chunk_rw<T, 16, 16, AL, SL>(blocks) : bm == 32 ? run_chunk_rw<T, 16, 32, AL, SL>(blocks) : 2;
    if (L.rw <= 64)
      return bm == 16   ? run_chunk_rw<T, 64, 16, AL, SL>(blocks)
             : bm == 32 ? run_chunk_rw<T, 64, 32, AL, SL>(blocks)
             : bm == 64 ? run_chunk_rw<T, 64, 64, AL, SL>(blocks)
                        : run_chunk_rw<T, 64, 128, AL, SL>(blocks);
    if (L.rw <= 128)
      return bm == 16   ? run_chunk_rw<T, 128, 16, AL, SL>(blocks)
             : bm == 32 ? run_chunk_rw<T, 128, 32, AL, SL>(blocks)
             : bm == 64 ? run_chunk_rw<T, 128, 64, AL, SL>(blocks)
                        : run_chunk_rw<T, 128, 128, AL, SL>(blocks);
    return 2;
  }
}
template <typename T, bool AL> static int run_chunk(int bm, int blocks) {
  return L.sliced ? run_chunk_sl<T, AL, true>(bm, blocks) : run_chunk_sl<T, AL, false>(bm, blocks);
}

// lora_one (one.cuh): each cluster's blocks run their shrink one after another, each into its own
// part (the kernel's shared memory, NaN before each cluster so a read of a row no block wrote
// shows), then each block its sum over the cluster's parts (distributed shared memory on the
// device) and its share of the columns.
// The ALIGNED 16-bit instantiations stage each block's share of A first (one_stage_a, the kernel's
// path with EARLY_READS), into g_one_stage (its dynamic shared memory, NaN before each block).
static std::vector<float> g_one_parts;
static std::vector<uint16_t> g_one_stage;
static int g_one_blocks = 0;
template <typename T, int RW, bool AL> static void one_shrink_block(int b) {
  static lora::OneStep st;
  static unsigned long long abar;
  auto g = args<T>();
  if (AL && sizeof(T) == 2 && threadIdx.x == 0) lora::mbar_init(&abar, blockDim.x);
  if (!lora::one_setup(g, st)) return;
  const int k = b % lora::ONE_CLUSTER;
  const T* sa = nullptr;
  if constexpr (AL && sizeof(T) == 2) {
    T* s = reinterpret_cast<T*>(g_one_stage.data());
    const bool staged = lora::one_stage_a<T>(g, st, k, s, &abar);
    __syncthreads();  // every arrival before any wait (the emulator cannot spin)
    if (staged) {
      lora::mbar_wait(&abar, 0);
      sa = s;
    }
  }
  lora::one_shrink<T, RW, AL>(g, st, g_one_parts.data() + k * lora::ONE_SLICES * RW, k, sa);
}
template <typename T, int RW, bool AL> static void one_expand_block(int b) {
  static lora::OneStep st;
  static float vs[lora::ONE_SLICES * RW];
  auto g = args<T>();
  if (!lora::one_setup(g, st)) return;
  lora::OneCol<T, RW, AL> pc;  // each fiber's own, as a thread's registers
  lora::one_prefetch<T, RW, AL>(g, st, b, g_one_blocks, pc);
  lora::one_prefetch_a<T>(g, st, b % lora::ONE_CLUSTER);
  lora::one_prefetch_y<T, RW, AL>(g, st, b, g_one_blocks, pc);
  lora::one_sum<RW>(g.n_slices, st, vs,
                    [](int peer, int e) { return g_one_parts[peer * lora::ONE_SLICES * RW + e]; });
  __syncthreads();
  lora::one_expand<T, RW, AL>(g, st, vs, b, g_one_blocks, pc);
}
template <typename T, int RW, bool AL> static int run_one_rw(int blocks) {
  if (blocks % lora::ONE_CLUSTER) return 2;
  g_one_blocks = blocks;
  for (int c = 0; c < blocks; c += lora::ONE_CLUSTER) {
    g_one_parts.assign(lora::ONE_CLUSTER * lora::ONE_SLICES * RW, NAN);
    for (int b = c; b < c + lora::ONE_CLUSTER; ++b) {
      const int pieces = (L.in_features * int(sizeof(T)) + 15) / 16;
      const int ld = lora::one_stage_ld<T>((pieces + lora::ONE_CLUSTER - 1) / lora::ONE_CLUSTER);
      g_one_stage.assign((size_t)lora::ONE_SLICES * RW * ld * sizeof(T) / 2, 0x7fc1);  // NaN in bf16 and fp16
      emu::run_block(one_shrink_block<T, RW, AL>, b);
    }
    for (int b = c; b < c + lora::ONE_CLUSTER; ++b) emu::run_block(one_expand_block<T, RW, AL>, b);
  }
  return 0;
}
template <typename T, bool AL> static int run_one(int bm, int blocks) {
  if (bm != 1 || L.bucket != 1) return 2;
  return L.max_rank <= 16 ? run_one_rw<T, 16, AL>(blocks)
         : L.max_rank <= 64 ? run_one_rw<T, 64, AL>(blocks)
         : L.max_rank <= 128 ? run_one_rw<T, 128, AL>(blocks) : 2;
}

static int g_blocks = 0;
template <typename T, int BM, int BN, bool CHUNKED, bool AL> static void fused_block(int u) {
  static lora::TileRows<BM> tr;
  auto g = args<T>();
  lora::fused_task<T, BM, BN, CHUNKED, AL>(g, dsm.data(), s_indptr, tr, g_blocks);
}

// expand 0 / 1: the fused launch on tiles / chunks (its blocks run in ticket order, every shrink
// task before any expand). AL: the kernels' ALIGNED instantiation (the host asks for it only
// where flags == 7, as the backend does).
template <typename T, int BM, int BN, bool AL> static void run(int expand, int shrink_blocks, int expand_blocks) {
  if (expand <= 1) {
    g_blocks = shrink_blocks + expand_blocks;
    for (int u = 0; u < g_blocks; ++u)
      emu::run_block(expand ? fused_block<T, BM, BN, true, AL> : fused_block<T, BM, BN, false, AL>, u);
    return;
  }
  for (int u = 0; u < shrink_blocks; ++u) emu::run_block(shrink_block<T, BM, AL>, u);
  if (expand == 5) {  // lora_expand_ring: tiles of 64 positions only
    if constexpr (BM == 64)
      for (int u = 0; u < expand_blocks; ++u) emu::run_block(ring_block<T, AL>, u);
    return;
  }
  for (int u = 0; u < expand_blocks; ++u)
    emu::run_block(expand == 4 ? stream_block<T, BM, AL> : expand_block<T, BM, BN, AL>, u);
}
template <typename T, bool AL> static int run_a(int bm, int expand, int sb, int eb) {
  if (bm == 16) run<T, 16, 64, AL>(expand, sb, eb);
  else if (bm == 32) run<T, 32, 128, AL>(expand, sb, eb);
  else if (bm == 64) run<T, 64, 128, AL>(expand, sb, eb);
  else return 2;
  return 0;
}
// Every block of a grid (gx, gy, gz) of `threads` threads, one at a time, with blockIdx and gridDim set
// for each (body's argument: the block's x).
static void run_grid(void (*fn)(int), int gx, int gy, int gz, int threads = 128) {
  emu::nthreads = threads;
  emu::grid_dim = EmuIdx{unsigned(gx), unsigned(gy), unsigned(gz)};
  for (int z = 0; z < gz; ++z)
    for (int yb = 0; yb < gy; ++yb)
      for (int x = 0; x < gx; ++x) {
        emu::block_idx = EmuIdx{unsigned(x), unsigned(yb), unsigned(z)};
        emu::run_block(fn, x);
      }
  emu::grid_dim = EmuIdx{1u, 1u, 1u};
  emu::block_idx = EmuIdx{0u, 0u, 0u};
  emu::nthreads = 128;
}
// lora_pair (pair.cuh): the shrink's grid (blocks of PAIR_SW warps), then the expand's (PAIR_EW warps),
// each block in turn with its blockIdx and the grid's size set, every shrink block before any expand
// block (the expand's wait); both with EARLY_READS, the order of the pool's calls (the waits are no-ops
// here). The instantiation as the backend picks it: rank width 16 (slices 1, 2, 3, 4, 8) or 64 (1, 2).
template <typename T, int NS, int RW, bool AL> static void pair_shrink_block(int) {
  auto g = args<T>();
  lora::pair_shrink<T, NS, RW, AL>(g, reinterpret_cast<int*>(dsm.data()));
}
template <typename T, int RW, bool AL> static void pair_expand_block(int) {
  auto g = args<T>();
  lora::pair_expand<T, RW, AL>(g, reinterpret_cast<int*>(dsm.data()));
}
template <typename T, int NS, int RW, bool AL> static int run_pair_ns(int sb, int eb) {
  const int flags = L.flags;
  L.flags |= lora::EARLY_READS;
  if (sb) run_grid(pair_shrink_block<T, NS, RW, AL>, sb, 1, 1, lora::PAIR_SW * 32);
  if (eb) run_grid(pair_expand_block<T, RW, AL>, eb, 1, 1, lora::PAIR_EW * 32);
  L.flags = flags;
  return 0;
}
template <typename T, bool AL> static int run_pair(int sb, int eb) {
  if constexpr (sizeof(T) != 2) {
    return 2;
  } else {
    const int n = L.n_slices;
    if (L.rw <= 16)
      return n <= 1   ? run_pair_ns<T, 1, 16, AL>(sb, eb)
             : n <= 2 ? run_pair_ns<T, 2, 16, AL>(sb, eb)
             : n <= 3 ? run_pair_ns<T, 3, 16, AL>(sb, eb)
             : n <= 4 ? run_pair_ns<T, 4, 16, AL>(sb, eb)
             : n <= 8 ? run_pair_ns<T, 8, 16, AL>(sb, eb)
                      : 2;
    if (L.rw <= 64) return n <= 1 ? run_pair_ns<T, 1, 64, AL>(sb, eb) : n <= 2 ? run_pair_ns<T, 2, 64, AL>(sb, eb) : 2;
    return 2;
  }
}

template <typename T> static int run_t(int bm, int expand, int sb, int eb) {
  if (L.aligned && L.flags != 7) return 3;  // the ALIGNED instantiation serves flags == 7 alone
  if (expand == 9) return L.aligned ? run_pair<T, true>(sb, eb) : run_pair<T, false>(sb, eb);
  if (expand == 6) return L.aligned ? run_chunk<T, true>(bm, sb) : run_chunk<T, false>(bm, sb);
  if (expand == 7) return L.aligned ? run_one<T, true>(bm, sb) : run_one<T, false>(bm, sb);
  return L.aligned ? run_a<T, true>(bm, expand, sb, eb) : run_a<T, false>(bm, expand, sb, eb);
}

extern "C" long long emu_mma_count() { return emu::mma_count; }
// dtype 0 bf16, 1 fp16, 2 fp32; expand 3 (lora_expand), 4 (lora_expand_stream), 5 (lora_expand_ring),
// 6 (lora_chunk: shrink_blocks its blocks), 7 (lora_one: shrink_blocks its blocks), 9 (lora_pair: shrink_blocks
// the shrink's grid, expand_blocks the expand's), 0 / 1 (the fused launch on tiles / chunks);
// dims: S n R in out bucket positions rw splits k_split col_blocks cpb chunked flags aligned b_slot
// sliced (lora_chunk's instantiation for several slices) b_ld b_blk (0 0: B [S, out, R])
extern "C" void emu_set_cp_early(int v) { emu::cp_early = v != 0; }
extern "C" int emu_delta(int dtype, int bm, int expand, int shrink_blocks, int expand_blocks, void* y, const void* x,
                         const void* A, const void* B, const float* scaling, const int* ranks, const int* out_offsets,
                         const int* token_order, const int* slot_indptr, float* ws, int* counters, const int* dims) {
  L = Launch{y, x, A, B, scaling, ranks, out_offsets, token_order, slot_indptr, ws, counters, dims[0], dims[1],
             dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8], dims[9], dims[10], dims[11], dims[12],
             dims[13], dims[14], dims[15], dims[16], dims[17], dims[18]};
  if (dtype == 0) return run_t<__nv_bfloat16>(bm, expand, shrink_blocks, expand_blocks);
  if (dtype == 1) return run_t<__half>(bm, expand, shrink_blocks, expand_blocks);
  return run_t<float>(bm, expand, shrink_blocks, expand_blocks);
}

// lora_expand_glu (expand_glu.cuh): L as emu_delta sets it (y = g) and the kernel's own operands.
struct GluLaunch {
  const void* up;
  void* h;
  int ld, ld_h, inter;
};
static GluLaunch GL;
template <typename T, int KS> static void glu_block(int u) {
  static lora::TileRows<64> tr;
  auto g = args<T>();
  lora::expand_glu_task<T, KS>(g, (const T*)GL.up, (T*)GL.h, GL.ld, GL.ld_h, GL.inter, dsm.data(), s_indptr, tr, u);
}
template <typename T> static int glu_grid(int ks, int blocks, int reverse) {
  void (*fn)(int) = ks == 1 ? glu_block<T, 1> : ks == 2 ? glu_block<T, 2> : ks == 4 ? glu_block<T, 4> : nullptr;
  if (!fn) return 2;
  // the bytes past Glu<T>::SMEM (on the device: s_indptr's) hold a pattern no stage may overwrite
  constexpr size_t smem = lora::Glu<T>::SMEM;
  memset(dsm.data() + smem, 0xa5, dsm.size() - smem);
  // reverse: the last block first, so a block that depends on another's having run shows
  for (int k = 0; k < blocks; ++k) emu::run_block(fn, reverse ? blocks - 1 - k : k);
  for (size_t i = smem; i < dsm.size(); ++i)
    if (dsm[i] != char(0xa5)) return 4;
  return 0;
}
// dtype 0 bf16, 1 fp16; ks k-steps (1, 2, 4); blocks = tiles * column groups; dims as emu_delta's
// (x and A unread) to b_slot, then ld ld_h inter b_ld b_blk. Returns 2 for another ks, 4 where shared memory past
// Glu<T>::SMEM was written.
extern "C" int emu_glu(int dtype, int ks, int blocks, int reverse, void* g, const void* up, void* h, const void* B,
                       const float* scaling, const int* ranks, const int* out_offsets, const int* token_order,
                       const int* slot_indptr, float* ws, int* counters, const int* dims) {
  L = Launch{g, nullptr, nullptr, B, scaling, ranks, out_offsets, token_order, slot_indptr, ws, counters, dims[0],
             dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8], dims[9], dims[10], dims[11],
             dims[12], dims[13], dims[14], dims[15]};
  L.b_ld = dims[19];  // 0 0: B [S, out, R]
  L.b_blk = dims[20];
  GL = GluLaunch{up, h, dims[16], dims[17], dims[18]};
  if (dtype == 0) return glu_grid<__nv_bfloat16>(ks, blocks, reverse);
  if (dtype == 1) return glu_grid<__half>(ks, blocks, reverse);
  return 3;
}

// lora_expand_v (expand_v.cu): every block of a grid (gx, gy, gz) of 128 threads, one at a time.
struct VLaunch {
  void *y0, *y1, *y2;
  long long ldy[3];
  int out[3], boff[3];
  const void *v, *B;
  long long ldv, b_slot;
  int b_ld;
  long long b_blk;
  const float* scaling;
  const int *ranks, *token_order, *slot_indptr;
  int num_slots, n, compact;
};
static VLaunch V;
template <typename T, int R> static void expand_v_block(int) {
  lora_expand_v<T, R, 8>((T*)V.y0, (T*)V.y1, (T*)V.y2, V.ldy[0], V.ldy[1], V.ldy[2], V.out[0], V.out[1], V.out[2],
                         V.boff[0], V.boff[1], V.boff[2], (const T*)V.v, V.ldv, (const T*)V.B, V.b_slot, V.b_ld, V.b_blk,
                         V.scaling,
                         V.ranks, V.token_order, V.slot_indptr, V.num_slots, V.n, V.compact);
}
template <typename T> static int expand_v_grid(int R, int gx, int gy, int gz) {
  void (*fn)(int) = R == 8 ? expand_v_block<T, 8> : R == 16 ? expand_v_block<T, 16> : R == 32 ? expand_v_block<T, 32>
                    : R == 64 ? expand_v_block<T, 64> : R == 128 ? expand_v_block<T, 128> : nullptr;
  if (!fn) return 2;
  run_grid(fn, gx, gy, gz);
  return 0;
}
// dtype 0 bf16, 1 fp16; ys[3], ldy[3], out[3], boff[3]; dims: R gx gy gz S n compact
extern "C" int emu_expand_v(int dtype, void** ys, const long long* ldy, const int* out, const int* boff, const void* v,
                            long long ldv, const void* B, long long b_slot, int b_ld, long long b_blk,
                            const float* scaling, const int* ranks,
                            const int* token_order, const int* slot_indptr, const int* dims) {
  V = VLaunch{ys[0], ys[1], ys[2], {ldy[0], ldy[1], ldy[2]}, {out[0], out[1], out[2]}, {boff[0], boff[1], boff[2]},
              v, B, ldv, b_slot, b_ld, b_blk, scaling, ranks, token_order, slot_indptr, dims[4], dims[5], dims[6]};
  if (dtype == 0) return expand_v_grid<__nv_bfloat16>(dims[0], dims[1], dims[2], dims[3]);
  if (dtype == 1) return expand_v_grid<__half>(dims[0], dims[1], dims[2], dims[3]);
  return 3;
}

// lora_gather_a (expand_v.cu): every block of a grid (gx, kb, entries), 128 threads here.
struct GLaunch {
  const long long* table;
  const int* slot_indptr;
  int num_slots;
};
static GLaunch G;
static void gather_block(int) { lora_gather_a(G.table, G.slot_indptr, G.num_slots); }
extern "C" int emu_gather_a(const long long* table, const int* slot_indptr, int num_slots, int gx, int kb, int entries) {
  G = GLaunch{table, slot_indptr, num_slots};
  run_grid(gather_block, gx, kb, entries);
  return 0;
}
