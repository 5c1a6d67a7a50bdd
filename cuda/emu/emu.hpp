// Host emulation of the CUDA device for the kernels in cuda/ (issue 13).
//
// build.rs compiles every cuda/*.cu file for the CPU with the system C++
// compiler (C++17, -ffp-contract=off as the device code's --fmad=false, no
// fast math), as one translation unit per file:
//
//     #include "emu.hpp"
//     namespace ts_emu_<file> {
//     #include "common.cuh"
//     #include "<file>.cu"
//     }
//     + the dynamic shared array's definition and the kernel table
//
// This header defines exactly the CUDA constructs our kernels use. Anything
// else (another intrinsic, atomics, inline PTX, a __shfl variant, ...) fails
// the build: an undeclared name is a compile error naming it, and inline PTX
// (`asm`) is a static_assert saying that it is not emulated. Add a construct
// here only together with a test of it.
//
// Execution model (runtime.cpp): a launch's blocks run on one or more OS
// threads (rayon's workers, in ranges of block indices; any order is CUDA's
// order), each block wholly on one OS thread; the threads of a block are
// fibers (a stack each once they first wait) switched cooperatively, so
// __syncthreads is a true barrier and a warp shuffle exchanges values only
// once all 32 lanes have arrived. Between two synchronisation points a thread
// runs alone, so a race the kernel has (a missing barrier) shows up as a
// wrong value, not as a nondeterministic one.
//
// Shared memory: `__shared__` is `thread_local`. A block-scope
// `__shared__ float scratch[32];` is then one object per OS thread, and since
// one OS thread runs one block at a time (a block's threads are fibers of
// that OS thread), it is exactly the block's shared memory, and blocks or
// launches on other OS threads have their own. `extern __shared__ T name[];`
// (dynamic shared memory) becomes a thread_local array of TS_EMU_DYN_SMEM_CAP
// bytes that build.rs defines in the file's namespace; a launch may use its
// first `shared_bytes`, which are filled with 0xff bytes (a NaN) at the start
// of every block, and the rest is a canary checked after every block.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <string>
#include <type_traits>
#include <utility>

// Dynamic shared memory capacity: the driver's 48 KiB without opt-in
// (launch::DEFAULT_SMEM_LIMIT), which the engine never exceeds.
#define TS_EMU_DYN_SMEM_CAP (48 * 1024)

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };

extern "C" {
// What one emulated thread sees (set by the scheduler before it runs a fiber).
struct ts_emu_thread {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};
extern __thread const ts_emu_thread* ts_emu_cur __attribute__((tls_model("initial-exec")));
void ts_emu_syncthreads(void);
unsigned long long ts_emu_shfl_xor(unsigned int mask, unsigned long long bits, int lane_mask, int width);
[[noreturn]] void ts_emu_trap(const char* what);

// One kernel of the table build.rs generates per translation unit.
struct ts_emu_kernel {
    const char* name;
    void* fn;
    void (*invoke)(void* fn, void** args);  // args as cuLaunchKernel's kernelParams
    const char* (*signature)(void);         // "*const f32, *mut f32, i32, f32"
    void* (*dyn_smem)(void);                // this thread's dynamic shared array (or null)
};
}

// 16-bit conversions with the device's rounding (common.cuh uses them under
// TS_EMU in place of its inline PTX).
// cvt.f32.f16: exact, subnormals kept (no flush to zero); NaN payload kept, quieted.
static inline float ts_emu_f16_to_f32(unsigned short h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  // subnormal: normalise
        int e = -1;
        uint32_t m = man;
        do { m <<= 1; ++e; } while ((m & 0x400u) == 0);
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
// cvt.rn.f16.f32: round to nearest even, overflow to inf, subnormal results
// rounded (no flush); NaN gives the canonical 0x7fff (its sign dropped).
static inline unsigned short ts_emu_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu;
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds to >= 65520: inf
    const int exp = (int)(a >> 23);
    if (exp >= 113) {  // normal f16 result: drop 13 bits, ties to even
        uint32_t r = a - (112u << 23);
        r += 0x0fffu + ((r >> 13) & 1u);
        return (unsigned short)(sign | (r >> 13));
    }
    if (exp < 102) return (unsigned short)sign;  // below half the smallest subnormal: 0
    // Subnormal f16: value = m * 2^(exp-150) with the implicit bit; the f16
    // unit is 2^-24, so shift right by 126 - exp bits, ties to even.
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const int shift = 126 - exp;  // 14..24
    const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
    const uint32_t r = q + ((rem > halfway || (rem == halfway && (q & 1u))) ? 1u : 0u);
    return (unsigned short)(sign | r);
}

namespace emu {

// Names of the parameter types, for the launch-time argument check.
template <class T> struct TypeName;  // a kernel parameter of another type: add it here
template <> struct TypeName<float> { static constexpr const char* name = "f32"; };
template <> struct TypeName<double> { static constexpr const char* name = "f64"; };
template <> struct TypeName<int> { static constexpr const char* name = "i32"; };
template <> struct TypeName<unsigned int> { static constexpr const char* name = "u32"; };
template <> struct TypeName<long long> { static constexpr const char* name = "i64"; };
template <> struct TypeName<unsigned long long> { static constexpr const char* name = "u64"; };
template <> struct TypeName<unsigned short> { static constexpr const char* name = "u16"; };

template <class T> std::string param_name() {
    if constexpr (std::is_pointer<T>::value) {
        using P = typename std::remove_pointer<T>::type;
        return std::string(std::is_const<P>::value ? "*const " : "*mut ") +
               TypeName<typename std::remove_cv<P>::type>::name;
    } else {
        return TypeName<T>::name;
    }
}

template <class F> struct Invoker;
template <class... A> struct Invoker<void (*)(A...)> {
    template <size_t... I>
    static void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
        f(*static_cast<A*>(args[I])...);
    }
    static void invoke(void* fn, void** args) {
        call(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
    }
    static const char* signature() {
        static const std::string s = [] {
            std::string r;
            const std::string parts[] = {std::string(), param_name<A>()...};
            for (size_t i = 1; i < sizeof...(A) + 1; ++i) r += (i > 1 ? ", " : "") + parts[i];
            return r;
        }();
        return s.c_str();
    }
};

}  // namespace emu

#ifndef TS_EMU_RUNTIME
// ---- the CUDA constructs, for the kernel translation units only ----

#define TS_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __shared__ thread_local
#define __restrict__ __restrict

#define threadIdx (ts_emu_cur->thread_idx)
#define blockIdx (ts_emu_cur->block_idx)
#define blockDim (ts_emu_cur->block_dim)
#define gridDim (ts_emu_cur->grid_dim)

// Inline PTX has no host meaning: the kernel sources put a C++ equivalent
// under #ifdef TS_EMU (common.cuh), and any other asm fails the build here.
#define asm(...) static_assert(false, "cuda/emu: inline PTX (asm) is not emulated; give it a TS_EMU C++ equivalent")

static inline void __syncthreads() { ts_emu_syncthreads(); }

// The full-warp xor shuffle, for 32- and 64-bit arithmetic types.
template <class T> static inline T __shfl_xor_sync(unsigned int mask, T v, int lane_mask, int width = 32) {
    static_assert(std::is_arithmetic<T>::value && sizeof(T) <= 8, "cuda/emu: __shfl_xor_sync of this type is not emulated");
    unsigned long long b = 0;
    memcpy(&b, &v, sizeof(T));
    b = ts_emu_shfl_xor(mask, b, lane_mask, width);
    T r;
    memcpy(&r, &b, sizeof(T));
    return r;
}

static inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
static inline float __uint_as_float(unsigned int x) { float f; memcpy(&f, &x, 4); return f; }
static inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
static inline unsigned int __float_as_uint(float x) { unsigned int i; memcpy(&i, &x, 4); return i; }
#endif
