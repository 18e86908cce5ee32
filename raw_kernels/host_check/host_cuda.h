// Host stand-ins for the CUDA features the lora kernels use, so their task functions compile with g++
// and run on a CPU: a block is 128 fibers (ucontext; 256 for lora_pair's expand) run one at a time;
// __syncthreads and the warp-collective operations (ballot, shuffle, m16n8k16) are barriers between
// fibers. Vector loads and stores check their alignment. Used by check.py; nothing here ships or runs
// on a GPU.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <ucontext.h>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#undef __shared__
#define __shared__ static
#undef __device__
#define __device__
#undef __global__
#define __global__
#undef __forceinline__
#define __forceinline__ inline
#undef __restrict__
#define __restrict__
#undef __align__
#define __align__(n) alignas(n)

// one.cuh's cluster helpers (inline PTX) are left out: the harness runs a cluster's blocks itself
#define LORA_HOST_EMULATION 1

namespace emu {
constexpr int NTHREADS = 256;  // the most threads a block of the harness runs (lora_pair's expand)
extern int nthreads;           // this block's: 128 but where a kernel's blocks are larger
struct Fiber {
  ucontext_t ctx;
  int tid;
  bool done;
  int wait;  // 0 runnable, 1 block barrier, 2 warp barrier
  std::vector<char> stack;
};
extern Fiber fibers[NTHREADS];
extern Fiber* cur;
extern ucontext_t sched_ctx;
extern int block_arrived, warp_arrived[NTHREADS / 32];
extern long long mma_count;
void block_barrier();
void warp_barrier();
// staging for warp collectives
struct Stage {
  float a[32][8], b[32][4];
  unsigned u[32];
  float f[32];
};
extern Stage stage[NTHREADS / 32];
inline int lane() { return cur->tid & 31; }
inline int warp() { return cur->tid >> 5; }
inline void check_align(const void* p, size_t n) {
  if (reinterpret_cast<uintptr_t>(p) % n) {
    fprintf(stderr, "misaligned %zu-byte access at %p (thread %d)\n", n, p, cur->tid);
    abort();
  }
}
}  // namespace emu

struct EmuIdx {
  unsigned x, y, z;
};
inline EmuIdx emu_tidx() { return EmuIdx{unsigned(emu::cur->tid), 0u, 0u}; }
#define threadIdx emu_tidx()
// kernels that read their block's place (lora_expand_v): the harness sets it before each block
namespace emu {
extern EmuIdx block_idx, grid_dim;
}
#define blockIdx emu::block_idx
#define gridDim emu::grid_dim
#define blockDim (EmuIdx{unsigned(emu::nthreads), 1u, 1u})
#undef __launch_bounds__
#define __launch_bounds__(...)

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
// the fast exponential and division (lora_expand_glu's silu) as the exact ones: math.h declares
// __expf, libm does not export it (a call would fail at its lazy binding)
extern "C" inline float __expf(float x) noexcept { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline void __syncthreads() { emu::block_barrier(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier(); }
inline int __syncthreads_or(int pred) {
  static int acc;
  emu::block_barrier();
  if (threadIdx.x == 0) acc = 0;
  emu::block_barrier();
  if (pred) acc = 1;
  emu::block_barrier();
  int r = acc;
  emu::block_barrier();
  return r;
}
inline unsigned __ballot_sync(unsigned, int pred) {
  auto& st = emu::stage[emu::warp()];
  st.u[emu::lane()] = pred ? 1u : 0u;
  emu::warp_barrier();
  unsigned m = 0;
  for (int l = 0; l < 32; ++l) m |= st.u[l] << l;
  emu::warp_barrier();
  return m;
}
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  auto& st = emu::stage[emu::warp()];
  st.f[emu::lane()] = v;
  emu::warp_barrier();
  float r = st.f[emu::lane() ^ mask];
  emu::warp_barrier();
  return r;
}
inline int __shfl_sync(unsigned, int v, int src) {
  auto& st = emu::stage[emu::warp()];
  st.u[emu::lane()] = (unsigned)v;
  emu::warp_barrier();
  const int r = (int)st.u[src & 31];
  emu::warp_barrier();
  return r;
}
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
inline int __shfl_up_sync(unsigned, int v, int delta) {
  auto& st = emu::stage[emu::warp()];
  st.u[emu::lane()] = (unsigned)v;
  emu::warp_barrier();
  const int r = emu::lane() >= delta ? (int)st.u[emu::lane() - delta] : v;
  emu::warp_barrier();
  return r;
}
inline void __threadfence() {}
inline void __nanosleep(unsigned) {}
inline void __trap() { abort(); }
inline int atomicAdd(int* p, int v) {
  int o = *p;
  *p = o + v;
  return o;
}
inline float atomicAdd(float* p, float v) {
  float o = *p;
  *p = o + v;
  return o;
}
inline int atomicExch(int* p, int v) {
  int o = *p;
  *p = v;
  return o;
}
template <typename P> inline P __ldg(const P* p) {
  emu::check_align(p, sizeof(P));
  return *p;
}
template <typename P> inline P __ldcs(const P* p) {
  emu::check_align(p, sizeof(P));
  return *p;
}
template <typename P> inline P __ldcg(const P* p) {
  emu::check_align(p, sizeof(P));
  return *p;
}
template <typename P> inline void __stcs(P* p, P v) {
  emu::check_align(p, sizeof(P));
  *p = v;
}
template <typename P> inline void __stcg(P* p, P v) {
  emu::check_align(p, sizeof(P));
  *p = v;
}

namespace emu {
// cp.async as the hardware may run it at its latest: a copy is recorded when issued and made only
// when a wait_group retires its group (or, with early set, at once: the other extreme).
struct Copy {
  void* dst;
  const void* src;
  int bytes;
};
struct AsyncQueue {
  std::vector<std::vector<Copy>> groups;
  std::vector<Copy> open;
};
extern AsyncQueue async_q[NTHREADS];
extern bool cp_early;
inline void apply(const Copy& c) {
  memset(c.dst, 0, 16);
  if (c.bytes) memcpy(c.dst, c.src, c.bytes);
}
}  // namespace emu

namespace lora {
inline void cp_async16(void* smem, const void* gmem, int src_bytes) {
  emu::check_align(smem, 16);
  emu::check_align(gmem, src_bytes ? 16 : 1);
  const emu::Copy c{smem, gmem, src_bytes};
  if (emu::cp_early) emu::apply(c);
  else emu::async_q[emu::cur->tid].open.push_back(c);
}
inline void cp_async16_cg(void* smem, const void* gmem, int src_bytes) { cp_async16(smem, gmem, src_bytes); }
inline void cp_async_commit() {
  auto& q = emu::async_q[emu::cur->tid];
  q.groups.push_back(std::move(q.open));
  q.open.clear();
}
template <int N> inline void cp_async_wait() {
  auto& q = emu::async_q[emu::cur->tid];
  while ((int)q.groups.size() > N) {
    for (const auto& c : q.groups.front()) emu::apply(c);
    q.groups.erase(q.groups.begin());
  }
}
inline unsigned dynamic_smem_size() { return 1u << 30; }
inline int load_acquire(const int* p) { return *p; }
inline int atomic_add_acq_rel(int* p, int v) {
  const int o = *p;
  *p = o + v;
  return o;
}
}  // namespace lora

// mbarriers and bulk copies (one.cuh's staged A): a copy lands only when a thread waits on its
// barrier (its bytes poisoned until then, so a read before the wait fails the check). The barrier
// word holds the arrivals still due in its first phase; a wait checks that every arrival came and
// that the copies bring exactly the bytes the arrivals announced, else aborts (a GPU would hang, or
// go on before a copy lands). One phase only (parity 0): the emulator runs no spin-wait, so the
// harness puts a block barrier between the arrivals and the wait.
namespace emu {
struct BulkCopy {
  void* dst;
  const void* src;
  unsigned bytes;
  unsigned long long* bar;
};
extern std::vector<BulkCopy> bulk_pending;
extern std::vector<std::pair<unsigned long long*, long long>> bulk_tx;  // bytes announced, less landed
inline long long& tx_of(unsigned long long* bar) {
  for (auto& e : bulk_tx)
    if (e.first == bar) return e.second;
  bulk_tx.emplace_back(bar, 0);
  return bulk_tx.back().second;
}
}  // namespace emu
namespace lora {
inline void mbar_init(unsigned long long* bar, unsigned count) {
  *bar = count;
  emu::tx_of(bar) = 0;
}
inline void mbar_arrive_tx(unsigned long long* bar, unsigned bytes) {
  if (*bar == 0) {
    fprintf(stderr, "mbarrier: an arrival past its count (thread %d)\n", emu::cur->tid);
    abort();
  }
  --*bar;
  emu::tx_of(bar) += bytes;
}
inline void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  emu::check_align(dst, 16);
  emu::check_align(src, 16);
  if (bytes == 0 || bytes % 16) {
    fprintf(stderr, "bulk copy of %u bytes (not a positive multiple of 16)\n", bytes);
    abort();
  }
  memset(dst, 0xff, bytes);  // NaN in every 16-bit type until it lands
  emu::bulk_pending.push_back(emu::BulkCopy{dst, src, bytes, bar});
}
inline void mbar_wait(unsigned long long* bar, unsigned parity) {
  auto& q = emu::bulk_pending;
  for (size_t i = 0; i < q.size();) {
    if (q[i].bar == bar) {
      memcpy(q[i].dst, q[i].src, q[i].bytes);
      emu::tx_of(bar) -= q[i].bytes;
      q.erase(q.begin() + long(i));
    } else {
      ++i;
    }
  }
  if (parity != 0 || *bar != 0 || emu::tx_of(bar) != 0) {
    fprintf(stderr, "mbarrier wait (parity %u): %llu arrivals and %lld bytes still due (thread %d)\n", parity, *bar,
            emu::tx_of(bar), emu::cur->tid);
    abort();
  }
}
}  // namespace lora

// m16n8k16 with fp32 accumulation: lanes stage their fragments, then each computes its outputs
// (the PTX fragment layout of mma.sync.m16n8k16.row.col).
template <typename M> inline float emu_half(unsigned w, int hi);
template <> inline float emu_half<__nv_bfloat16>(unsigned w, int hi) {
  return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16));
}
template <> inline float emu_half<__half>(unsigned w, int hi) {
  __half_raw r;
  r.x = (unsigned short)(hi ? (w >> 16) : (w & 0xffffu));
  return __half2float(__half(r));
}
template <typename M> inline void emu_mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  auto& st = emu::stage[emu::warp()];
  const int l = emu::lane();
  for (int i = 0; i < 4; ++i) {
    st.a[l][2 * i] = emu_half<M>(a[i], 0);
    st.a[l][2 * i + 1] = emu_half<M>(a[i], 1);
  }
  for (int i = 0; i < 2; ++i) {
    st.b[l][2 * i] = emu_half<M>(b[i], 0);
    st.b[l][2 * i + 1] = emu_half<M>(b[i], 1);
  }
  emu::warp_barrier();
  auto A = [&](int row, int k) { return st.a[4 * (row % 8) + (k % 8) / 2][2 * ((row >= 8) + 2 * (k >= 8)) + k % 2]; };
  auto B = [&](int k, int nn) { return st.b[4 * nn + (k % 8) / 2][2 * (k >= 8) + k % 2]; };
  const int g = l >> 2, tq = l & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >= 2), col = 2 * tq + (i & 1);
    double s = d[i];
    for (int k = 0; k < 16; ++k) s += (double)A(row, k) * (double)B(k, col);
    d[i] = (float)s;
  }
  ++emu::mma_count;
  emu::warp_barrier();
}
#define EMU_MMA_SPECIALIZATIONS                                                                          \
  template <> inline void mma16816<__nv_bfloat16>(float(&d)[4], const unsigned(&a)[4], const unsigned(&b)[2]) { \
    emu_mma<__nv_bfloat16>(d, a, b);                                                                      \
  }                                                                                                       \
  template <> inline void mma16816<__half>(float(&d)[4], const unsigned(&a)[4], const unsigned(&b)[2]) { \
    emu_mma<__half>(d, a, b);                                                                             \
  }
