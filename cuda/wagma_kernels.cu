// wagma_comm's device kernels: the reduction steps of the DAG lowering, the
// fused WAGMA average, and the segment copy that packs tensors into one flat
// buffer and back. Loaded at run time by wagma_comm/kernels/device.py through
// CuPy RawModule (NVRTC); `make test` also compiles this file with nvcc for
// sm_80 and sm_90 with warnings as errors, so it builds on machines without a GPU.
//
// Conventions (kept in step with kernels/host.py):
//  * 16-bit floats are computed in float32 and rounded back to nearest-even;
//    float32/float64 in their own precision; integers wrap (computed unsigned).
//  * max/min propagate NaN from either operand.
//  * Every kernel takes an element count and handles any length: the vector
//    path moves 16 bytes per thread per step when every pointer is 16-byte
//    aligned (the host chooses the kernel), the rest goes element by element.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace wagma {

// Fixed-width names without <stdint.h>, which NVRTC does not ship.
typedef int i32;
typedef long long i64;
typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

// ---------------------------------------------------------------- arithmetic
template <typename T> struct Acc { typedef T type; };
template <> struct Acc<__half> { typedef float type; };
template <> struct Acc<__nv_bfloat16> { typedef float type; };
template <> struct Acc<i32> { typedef u32 type; };  // wrap, no UB
template <> struct Acc<i64> { typedef u64 type; };
template <> struct Acc<u8> { typedef u32 type; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type widen(T x) {
  return static_cast<typename Acc<T>::type>(x);
}
template <> __device__ __forceinline__ float widen<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T narrow(typename Acc<T>::type x) {
  return static_cast<T>(x);
}
template <> __device__ __forceinline__ __half narrow<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

enum Op { OP_SUM = 0, OP_PROD = 1, OP_MAX = 2, OP_MIN = 3 };

// Signed integers are reduced as their wrapped (unsigned) images, so max/min
// must compare the signed values.
template <typename T> struct Compare { typedef typename Acc<T>::type type; };
template <> struct Compare<i32> { typedef i32 type; };
template <> struct Compare<i64> { typedef i64 type; };

template <typename T, int OP>
__device__ __forceinline__ T combine(T a, T b) {
  typedef typename Acc<T>::type A;
  if (OP == OP_SUM) return narrow<T>(static_cast<A>(widen(a) + widen(b)));
  if (OP == OP_PROD) return narrow<T>(static_cast<A>(widen(a) * widen(b)));
  typedef typename Compare<T>::type C;
  const C x = static_cast<C>(widen(a)), y = static_cast<C>(widen(b));
  // x != x: a is NaN (propagate it); if b is NaN, neither comparison holds
  // and b (the NaN) is returned.
  const bool keep_a = (OP == OP_MAX) ? (x > y || x != x) : (x < y || x != x);
  return keep_a ? a : b;
}

// ------------------------------------------------------------------- vectors
// 16-byte aligned: load16/store16 access e as one uint4, which needs it should
// the compiler ever place a Vec in local memory instead of registers.
template <typename T> struct alignas(16) Vec {
  static const int N = 16 / sizeof(T);
  T e[16 / sizeof(T)];
};
static_assert(alignof(Vec<__half>) == 16 && alignof(Vec<u8>) == 16 && sizeof(Vec<u8>) == 16,
              "a Vec must be one aligned 16-byte word");

template <typename T> __device__ __forceinline__ Vec<T> load16(const T* p) {
  Vec<T> v;
  *reinterpret_cast<uint4*>(v.e) = __ldg(reinterpret_cast<const uint4*>(p));
  return v;
}
template <typename T> __device__ __forceinline__ void store16(T* p, const Vec<T>& v) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v.e);
}

__device__ __forceinline__ u64 thread_index() {
  return static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ u64 thread_count() {
  return static_cast<u64>(gridDim.x) * blockDim.x;
}

// ------------------------------------------------------------------ kernels

// dst[i] = op(dst[i], src[i]) for i < n. VEC: dst and src are 16-byte aligned.
template <typename T, int OP, bool VEC>
__global__ void reduce_into(T* __restrict__ dst, const T* __restrict__ src, u64 n) {
  u64 done = 0;
  if (VEC) {
    const int N = Vec<T>::N;
    const u64 nvec = n / N;
    for (u64 v = thread_index(); v < nvec; v += thread_count()) {
      Vec<T> a = load16(dst + v * N);
      const Vec<T> b = load16(src + v * N);
#pragma unroll
      for (int k = 0; k < N; ++k) a.e[k] = combine<T, OP>(a.e[k], b.e[k]);
      store16(dst + v * N, a);
    }
    done = nvec * N;
  }
  for (u64 i = done + thread_index(); i < n; i += thread_count())
    dst[i] = combine<T, OP>(dst[i], src[i]);
}

// Floor division of integers (Python's //, as the host kernels do).
template <typename T> __device__ __forceinline__ T floor_div(T a, T d) {
  T q = a / d;
  if ((a % d != 0) && ((a < 0) != (d < 0))) --q;
  return q;
}

template <typename T> __device__ __forceinline__ T divide(T x, double divisor) {
  return narrow<T>(static_cast<typename Acc<T>::type>(widen(x) / static_cast<float>(divisor)));
}
template <> __device__ __forceinline__ double divide<double>(double x, double divisor) {
  return x / divisor;
}
template <> __device__ __forceinline__ i32 divide<i32>(i32 x, double divisor) {
  return floor_div<i64>(x, static_cast<i64>(divisor));
}
template <> __device__ __forceinline__ i64 divide<i64>(i64 x, double divisor) {
  return floor_div<i64>(x, static_cast<i64>(divisor));
}
template <> __device__ __forceinline__ u8 divide<u8>(u8 x, double divisor) {
  return static_cast<u8>(x / static_cast<u32>(divisor));
}

// dst[i] /= divisor (the last step of an average).
template <typename T, bool VEC>
__global__ void scale_by(T* __restrict__ dst, u64 n, double divisor) {
  u64 done = 0;
  if (VEC) {
    const int N = Vec<T>::N;
    const u64 nvec = n / N;
    for (u64 v = thread_index(); v < nvec; v += thread_count()) {
      Vec<T> a = load16(dst + v * N);
#pragma unroll
      for (int k = 0; k < N; ++k) a.e[k] = divide<T>(a.e[k], divisor);
      store16(dst + v * N, a);
    }
    done = nvec * N;
  }
  for (u64 i = done + thread_index(); i < n; i += thread_count())
    dst[i] = divide<T>(dst[i], divisor);
}

// The fused WAGMA average: out = (inputs[0] + ... + inputs[k-1]) / divisor in
// one pass, accumulated in float32 for 16-bit floats (float64 for float64).
// With the group's models and one's own model as inputs and divisor S+1 this is
// ALGORITHMS.md's W = (sum_j w_j + w_i) / (S+1). out may alias an input
// (each element is read before it is written, by the same thread).
template <typename T, bool VEC>
__global__ void average_of(T* out, const unsigned long long* __restrict__ inputs, int k,
                           u64 n, double divisor) {
  typedef typename Acc<T>::type A;
  const A scale = static_cast<A>(1.0 / divisor);
  u64 done = 0;
  if (VEC) {
    const int N = Vec<T>::N;
    const u64 nvec = n / N;
    for (u64 v = thread_index(); v < nvec; v += thread_count()) {
      A acc[Vec<T>::N];
      const Vec<T> first = load16(reinterpret_cast<const T*>(inputs[0]) + v * N);
#pragma unroll
      for (int e = 0; e < N; ++e) acc[e] = widen(first.e[e]);
      for (int j = 1; j < k; ++j) {
        const Vec<T> x = load16(reinterpret_cast<const T*>(inputs[j]) + v * N);
#pragma unroll
        for (int e = 0; e < N; ++e) acc[e] += widen(x.e[e]);
      }
      Vec<T> r;
#pragma unroll
      for (int e = 0; e < N; ++e) r.e[e] = narrow<T>(acc[e] * scale);
      store16(out + v * N, r);
    }
    done = nvec * N;
  }
  for (u64 i = done + thread_index(); i < n; i += thread_count()) {
    A acc = widen(reinterpret_cast<const T*>(inputs[0])[i]);
    for (int j = 1; j < k; ++j) acc += widen(reinterpret_cast<const T*>(inputs[j])[i]);
    out[i] = narrow<T>(acc * scale);
  }
}

}  // namespace wagma

// Copies segment s (sizes[s] bytes) from srcs[s] to dsts[s]; blockIdx.y is the
// segment. Packing tensors into one flat buffer and unpacking it are both this
// kernel with the pointer lists swapped. 16-byte steps where both ends of a
// segment are 16-byte aligned, bytes otherwise.
extern "C" __global__ void copy_segments(const unsigned long long* __restrict__ dsts,
                                         const unsigned long long* __restrict__ srcs,
                                         const unsigned long long* __restrict__ sizes) {
  const unsigned s = blockIdx.y;
  unsigned char* dst = reinterpret_cast<unsigned char*>(dsts[s]);
  const unsigned char* src = reinterpret_cast<const unsigned char*>(srcs[s]);
  const wagma::u64 n = sizes[s];
  const wagma::u64 start = static_cast<wagma::u64>(blockIdx.x) * blockDim.x + threadIdx.x;
  const wagma::u64 stride = static_cast<wagma::u64>(gridDim.x) * blockDim.x;
  wagma::u64 done = 0;
  if (((dsts[s] | srcs[s]) & 15u) == 0) {
    const wagma::u64 nvec = n / 16;
    for (wagma::u64 v = start; v < nvec; v += stride)
      reinterpret_cast<uint4*>(dst)[v] = __ldg(reinterpret_cast<const uint4*>(src) + v);
    done = nvec * 16;
  }
  for (wagma::u64 i = done + start; i < n; i += stride) dst[i] = src[i];
}

// Explicit instantiations, so that nvcc compiles every variant the runtime can
// ask NVRTC for (CI has no GPU: this is where a template error shows).
#define WAGMA_REDUCE(T)                                                         \
  template __global__ void wagma::reduce_into<T, 0, true>(T*, const T*, u64);  \
  template __global__ void wagma::reduce_into<T, 0, false>(T*, const T*, u64); \
  template __global__ void wagma::reduce_into<T, 1, true>(T*, const T*, u64);  \
  template __global__ void wagma::reduce_into<T, 1, false>(T*, const T*, u64); \
  template __global__ void wagma::reduce_into<T, 2, true>(T*, const T*, u64);  \
  template __global__ void wagma::reduce_into<T, 2, false>(T*, const T*, u64); \
  template __global__ void wagma::reduce_into<T, 3, true>(T*, const T*, u64);  \
  template __global__ void wagma::reduce_into<T, 3, false>(T*, const T*, u64); \
  template __global__ void wagma::scale_by<T, true>(T*, u64, double);          \
  template __global__ void wagma::scale_by<T, false>(T*, u64, double);
WAGMA_REDUCE(__half)
WAGMA_REDUCE(__nv_bfloat16)
WAGMA_REDUCE(float)
WAGMA_REDUCE(double)
WAGMA_REDUCE(wagma::i32)
WAGMA_REDUCE(wagma::i64)
WAGMA_REDUCE(wagma::u8)
#define WAGMA_AVERAGE(T)                                                                     \
  template __global__ void wagma::average_of<T, true>(T*, const unsigned long long*, int,   \
                                                      u64, double);                      \
  template __global__ void wagma::average_of<T, false>(T*, const unsigned long long*, int,  \
                                                       u64, double);
WAGMA_AVERAGE(__half)
WAGMA_AVERAGE(__nv_bfloat16)
WAGMA_AVERAGE(float)
WAGMA_AVERAGE(double)
