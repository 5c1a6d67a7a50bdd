// Greedy token selection on the device: the index of the largest logit, with the
// exact semantics of the host's `sampling::argmax` (a sequential scan with `>`
// that keeps the first maximum and lets no NaN win): among non-NaN values the
// largest wins, ties go to the lower index; if every value is NaN the scan ends
// on the last index. That preference is a strict total order on (value, index),
// so any reduction tree gives the scan's answer.
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

// ---------------------------------------------------------------------------
// Seeded random sampling on the device, the algorithm of the host's
// `sampling::Sampler` (src/sampling.rs) so that one seed draws the same tokens
// on both engines, with only the sampled token copied back:
//   candidates  finite logits, ranked by (value desc, index asc);
//   top-k       the k best candidates (k = max(top_k, 1));
//   weights     w = exp((l - max) / temperature) in f64, normalised by their sum;
//   top-p       the shortest ranked prefix whose mass reaches p, renormalised;
//   draw        u in [0, 1) from ChaCha8 (below); the first ranked token whose
//               cumulative mass exceeds u, else the last one kept.
// The host sorts; here nothing is sorted. Each "ranked prefix" is the set of
// tokens whose rank key (value bits mapped to an order-preserving u32, then the
// inverted index) is >= a threshold, and each threshold is built bit by bit from
// the most significant one: 64 block-wide reductions find the largest threshold
// whose prefix still satisfies the predicate (at least k tokens; mass >= p; mass
// > u), and that threshold is exactly the key of the prefix's last token. Sums
// are in f64 in a fixed reduction order, so a run is bitwise reproducible; they
// are not in the host's sorted order, so the two engines can part only when u
// falls within f64 rounding of a cumulative boundary (or their logits differ).
// Launch: one block, blockDim a multiple of 32 (<= 1024); `w` is f64 scratch of
// n elements; `key` the 8 ChaCha key words; `draw` the index of this draw in
// the run (the host's Sampler draws one u64 per random sampling call).

__device__ __forceinline__ unsigned int rotl32(unsigned int x, int r) { return (x << r) | (x >> (32 - r)); }

#define TS_QR(a, b, c, d)                      \
    a += b; d ^= a; d = rotl32(d, 16);         \
    c += d; b ^= c; b = rotl32(b, 12);         \
    a += b; d ^= a; d = rotl32(d, 8);          \
    c += d; b ^= c; b = rotl32(b, 7);

// u64 number `draw` of rand_chacha's ChaCha8Rng stream 0 for the 256-bit key:
// block `draw / 8` (64-bit block counter in words 12-13, stream in 14-15), words
// 2*(draw % 8) (low half) and the next (high half). Fully unrolled with the
// word picked by comparison, so the state stays in registers.
__device__ __forceinline__ unsigned long long chacha8_u64(const unsigned int* key, unsigned long long draw) {
    const unsigned long long block = draw >> 3;
    const int word = (int)(draw & 7ull) * 2;
    unsigned int s[16] = {0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u,
                          key[0], key[1], key[2], key[3], key[4], key[5], key[6], key[7],
                          (unsigned int)block, (unsigned int)(block >> 32), 0u, 0u};
    unsigned int x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = s[i];
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // 4 double rounds = 8 rounds
        TS_QR(x[0], x[4], x[8], x[12]) TS_QR(x[1], x[5], x[9], x[13])
        TS_QR(x[2], x[6], x[10], x[14]) TS_QR(x[3], x[7], x[11], x[15])
        TS_QR(x[0], x[5], x[10], x[15]) TS_QR(x[1], x[6], x[11], x[12])
        TS_QR(x[2], x[7], x[8], x[13]) TS_QR(x[3], x[4], x[9], x[14])
    }
    unsigned int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
        if (i == word) { lo = x[i] + s[i]; hi = x[i + 1] + s[i + 1]; }
    }
    return ((unsigned long long)hi << 32) | lo;
}

// rand's f64 in [0, 1) from a u64: the top 53 bits times 2^-53.
__device__ __forceinline__ double unit_f64(unsigned long long r) {
    return (double)(r >> 11) * (1.0 / 9007199254740992.0);
}

__device__ __forceinline__ bool is_finite_f32(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// Larger key = better rank: the value's bits mapped so unsigned order is
// f32 total order (what the host's total_cmp sorts by), then 0xffffffff - index
// so that among equal values the lower index ranks first. Every finite value's
// key is > 0, so a threshold of 0 means "every candidate".
__device__ __forceinline__ unsigned long long rank_key(float v, int i) {
    const unsigned int b = __float_as_uint(v);
    const unsigned int o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)o << 32) | (unsigned long long)(0xffffffffu - (unsigned int)i);
}

// Block sums with the combination order of common.cuh's block_sum.
template <typename T>
__device__ __forceinline__ T block_sum_t(T v, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : (T)0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ unsigned long long block_min_u64(unsigned long long v, unsigned long long* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long ov = __shfl_xor_sync(0xffffffffu, v, o);
        v = ov < v ? ov : v;
    }
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : ~0ull;
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long ov = __shfl_xor_sync(0xffffffffu, v, o);
        v = ov < v ? ov : v;
    }
    return v;
}

template <typename T>
__device__ __forceinline__ void sample(const T* x, int n, float temperature, long long top_k, float top_p,
                                       int has_top_p, const unsigned int* key, unsigned long long draw, double* w,
                                       unsigned int* out) {
    __shared__ unsigned long long sk[32];
    __shared__ double sd[32];
    __shared__ float sf[32];

    // Candidates: the finite logits. None: the host falls back to argmax.
    unsigned long long cnt = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) cnt += is_finite_f32(to_f32(x[i])) ? 1ull : 0ull;
    cnt = block_sum_t(cnt, sk);
    if (cnt == 0) {
        argmax<T>(x, n, out);
        return;
    }

    // top-k: tk = the k-th largest key (0: every candidate).
    const unsigned long long k = (top_k > 0 && (unsigned long long)top_k < cnt) ? (unsigned long long)top_k : cnt;
    unsigned long long tk = 0;
    if (k < cnt) {
        for (int b = 63; b >= 0; --b) {
            const unsigned long long t = tk | (1ull << b);
            unsigned long long c = 0;
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const float v = to_f32(x[i]);
                c += (is_finite_f32(v) && rank_key(v, i) >= t) ? 1ull : 0ull;
            }
            if (block_sum_t(c, sk) >= k) tk = t;
        }
    }

    // Weights relative to the best candidate (the largest finite value).
    float m = -TS_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = to_f32(x[i]);
        if (is_finite_f32(v)) m = fmaxf(m, v);
    }
    m = block_max(m, sf);
    double total = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = to_f32(x[i]);
        double wi = 0.0;
        if (is_finite_f32(v) && rank_key(v, i) >= tk) wi = exp(((double)v - (double)m) / (double)temperature);
        w[i] = wi;  // read back below by this same thread only
        total += wi;
    }
    total = block_sum_t(total, sd);

    // top-p: tp = the largest threshold whose prefix (of the top-k set) is
    // non-empty and holds normalised mass >= p (0: no prefix does; keep all).
    unsigned long long tp = 0;
    if (has_top_p) {
        for (int b = 63; b >= 0; --b) {
            const unsigned long long t = tp | (1ull << b);
            unsigned long long c = 0;
            double mass = 0.0;
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const float v = to_f32(x[i]);
                if (is_finite_f32(v)) {
                    const unsigned long long r = rank_key(v, i);
                    if (r >= tk && r >= t) {
                        c += 1ull;
                        mass += w[i] / total;
                    }
                }
            }
            c = block_sum_t(c, sk);
            mass = block_sum_t(mass, sd);
            if (c >= 1ull && mass >= (double)top_p) tp = t;
        }
    }
    const unsigned long long keep = tk > tp ? tk : tp;
    // The kept mass, to renormalise after top-p (as the host does).
    double kept = 1.0;
    if (has_top_p) {
        kept = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = to_f32(x[i]);
            if (is_finite_f32(v) && rank_key(v, i) >= keep) kept += w[i] / total;
        }
        kept = block_sum_t(kept, sd);
    }

    // The draw: the largest threshold whose prefix mass exceeds u is the key of
    // the first ranked token whose cumulative mass does.
    const double u = unit_f64(chacha8_u64(key, draw));
    unsigned long long td = 0;
    for (int b = 63; b >= 0; --b) {
        const unsigned long long t = td | (1ull << b);
        double mass = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = to_f32(x[i]);
            if (is_finite_f32(v)) {
                const unsigned long long r = rank_key(v, i);
                if (r >= keep && r >= t) mass += has_top_p ? (w[i] / total) / kept : w[i] / total;
            }
        }
        if (block_sum_t(mass, sd) > u) td = t;
    }
    if (td == 0) {
        // u beyond the total mass (rounding): the last token kept.
        unsigned long long lowest = ~0ull;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = to_f32(x[i]);
            if (is_finite_f32(v)) {
                const unsigned long long r = rank_key(v, i);
                if (r >= keep && r < lowest) lowest = r;
            }
        }
        td = block_min_u64(lowest, sk);
    }
    if (threadIdx.x == 0) *out = 0xffffffffu - (unsigned int)(td & 0xffffffffull);
}

#define SAMPLE_OP(NAME, T)                                                                                     \
    extern "C" __global__ void NAME(const T* x, int n, float temperature, long long top_k, float top_p,         \
                                    int has_top_p, const unsigned int* key, unsigned long long draw, double* w, \
                                    unsigned int* out) {                                                       \
        sample<T>(x, n, temperature, top_k, top_p, has_top_p, key, draw, w, out);                             \
    }
SAMPLE_OP(sample_f32, float)
SAMPLE_OP(sample_f16, f16_t)
SAMPLE_OP(sample_bf16, bf16_t)
