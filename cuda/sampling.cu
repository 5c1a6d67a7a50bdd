// Greedy token selection on the device: the index of the largest logit, with the
// exact semantics of the host's `sampling::argmax` (a sequential scan with `>`
// that keeps the first maximum and lets no NaN win): among non-NaN values the
// largest wins, ties go to the lower index; if every value is NaN the scan ends
// on the last index. That preference is a strict total order on (value, index),
// so any reduction tree gives the scan's answer. Seeded random sampling runs on
// the host (src/sampling.rs) from the last logits row copied back, so the same
// seed draws the same tokens as the CPU engine.
// Launch: one block, blockDim a multiple of 32 (<= 1024); out is one u32.

__device__ __forceinline__ bool argmax_prefers(float va, int ia, float vb, int ib) {
    const bool na = va != va, nb = vb != vb;
    if (na != nb) return nb;           // a non-NaN beats a NaN
    if (na) return ia > ib;            // all NaN: the last index
    if (va != vb) return va > vb;
    return ia < ib;                    // equal: the first index
}

template <typename T>
__device__ __forceinline__ void argmax(const T* x, int n, unsigned int* out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float bv = __int_as_float(0x7fc00000);  // NaN, index -1: loses to any element
    int bi = -1;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = to_f32(x[i]);
        if (bi < 0 || argmax_prefers(v, i, bv, bi)) { bv = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || argmax_prefers(ov, oi, bv, bi))) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int nwarps = (blockDim.x + 31) >> 5;
        bv = lane < nwarps ? sv[lane] : __int_as_float(0x7fc00000);
        bi = lane < nwarps ? si[lane] : -1;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || argmax_prefers(ov, oi, bv, bi))) { bv = ov; bi = oi; }
        }
        if (lane == 0) *out = (unsigned int)(bi < 0 ? 0 : bi);
    }
}

extern "C" __global__ void argmax_f32(const float* x, int n, unsigned int* out) { argmax<float>(x, n, out); }
extern "C" __global__ void argmax_f16(const f16_t* x, int n, unsigned int* out) { argmax<f16_t>(x, n, out); }
extern "C" __global__ void argmax_bf16(const bf16_t* x, int n, unsigned int* out) { argmax<bf16_t>(x, n, out); }
