// Shared helpers of the lora-cupy kernels: element conversions and the slot lookup.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace lora {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// The slot whose range of token_order holds position p: the s with
// slot_indptr[s] <= p < slot_indptr[s + 1], or -1 past every range (a bucket's padding).
__device__ __forceinline__ int slot_of_position(const int* __restrict__ slot_indptr, int num_slots, int p) {
  if (p >= slot_indptr[num_slots]) return -1;
  int lo = 0, hi = num_slots;  // invariant: indptr[lo] <= p < indptr[hi]
  while (hi - lo > 1) {
    int mid = (lo + hi) >> 1;
    if (slot_indptr[mid] <= p) lo = mid; else hi = mid;
  }
  return lo;
}

}  // namespace lora
