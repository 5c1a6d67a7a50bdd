// Shared by every kernel file: the Rust side compiles `common.cuh` followed by
// one `.cu` file as a single NVRTC program (NVRTC has no <math.h> and we want
// no dependency on the toolkit's <cuda_fp16.h>/<cuda_bf16.h>, so the 16-bit
// storage types and the reductions are defined here by hand).
//
// Numerics contract (see src/engine/cuda/compile.rs for the options): every
// kernel computes in f32 whatever the storage type, is compiled with
// --fmad=false (products rounded before they are added, as the CPU engine's
// Rust code does) and without --use_fast_math (IEEE sqrt/div, accurate expf).

#define TS_INF __int_as_float(0x7f800000)

// 16-bit storage types: plain bit containers, distinct so overloads work.
struct f16_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(f16_t x) {
#ifdef TS_EMU  // host emulation (cuda/emu/emu.hpp): the same conversion in C++
    return ts_emu_f16_to_f32(x.bits);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
#endif
}
__device__ __forceinline__ float to_f32(bf16_t x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ f16_t from_f32<f16_t>(float x) {
    f16_t h;
#ifdef TS_EMU  // host emulation (cuda/emu/emu.hpp): the same rounding in C++
    h.bits = ts_emu_f32_to_f16(x);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#endif
    return h;
}
// Round to nearest even, NaN kept quiet (what the `half` crate does on the host).
template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float x) {
    unsigned int u = __float_as_uint(x);
    bf16_t b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        b.bits = (unsigned short)((u >> 16) | 0x0040u);
        return b;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    b.bits = (unsigned short)(u >> 16);
    return b;
}

// Warp and block reductions with a fixed combination order (xor butterfly,
// then warp partials in warp order), so results are bitwise reproducible.
// Block reductions need blockDim.x to be a multiple of 32 (<= 1024); every
// thread gets the result. `scratch` is a __shared__ float[32].
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : -TS_INF;
    return warp_max(v);
}

// Grid-stride loop over [0, n) with 64-bit indices.
#define TS_GRID_LOOP(i, n)                                                        \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)
