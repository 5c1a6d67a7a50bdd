// Mixture-of-experts kernels (src/engine/cuda/moe.rs), the CPU engine's
// arithmetic (src/engine/cpu/moe.rs) in the same f32 order:
//
// - moe_route: one thread per token row (grid-stride over rows). Scores from
//   the stored router logits in f32 (kind 0 softmax: max, exp(x - max) summed
//   in index order, divided; kind 1 sigmoid 1 / (1 + exp(-x)); kind 2 the
//   logits themselves), plus the correction bias where given: the selection
//   scores, written to `probs` (which is also the row's scratch). With groups,
//   a group's score is the sum of its two largest selection scores and only
//   the `topk_group` best groups (ties to the lower group) are eligible. Top-k
//   by repeated maximum over eligible experts, a tie to the lower id; the ids
//   are written ascending. Weights: the unbiased scores at the ids
//   (recomputed from the logits, the same f32 operations), softmax over the k
//   logits for kind 2, else divided by their sum when `norm`, times `scaling`.
// - moe_gather: rows idx[i] of src into dst (an expert's tokens).
// - moe_accumulate: acc[idx[i]] += w[i] * y[i] in f32 (one expert's output
//   into the routed sum; experts are launched in ascending id order, so every
//   row sums its experts in that order, as the CPU engine).
// - moe_store: the f32 routed sum rounded to storage.
// - sigmoid_scale: x[r, c] = sigmoid(g[r]) * x[r, c] (Qwen2-MoE's shared
//   expert gate).
// - swiglu_clamped: gpt-oss's expert activation in HF's f32 order:
//   g = min(gate, limit), u = clamp(up, -limit, limit), glu = g * sigmoid(g *
//   alpha), out = (u + 1) * glu, stored.
// Launch: 1-D grid-stride.

#define TS_MOE_MAX_GROUPS 64

template <typename T>
__device__ __forceinline__ float moe_raw(const T* l, int j, int kind, float mx, float sum) {
    const float x = to_f32(l[j]);
    if (kind == 0) return expf(x - mx) / sum;
    if (kind == 1) return 1.0f / (1.0f + expf(-x));
    return x;
}

template <typename T>
__device__ __forceinline__ void moe_route(const T* logits, const T* bias, float* probs, float* ids,
                                          float* weights, int rows, int n, int k, int kind, int norm,
                                          float scaling, int n_group, int topk_group) {
    TS_GRID_LOOP(r, (long long)rows) {
        const T* l = logits + r * n;
        float* sel = probs + r * n;
        float mx = -TS_INF, sum = 0.0f;
        if (kind == 0) {
            for (int j = 0; j < n; ++j) mx = fmaxf(mx, to_f32(l[j]));
            for (int j = 0; j < n; ++j) sum += expf(to_f32(l[j]) - mx);
        }
        for (int j = 0; j < n; ++j) {
            float s = moe_raw(l, j, kind, mx, sum);
            if (bias) s += to_f32(bias[j]);
            sel[j] = s;
        }
        // Eligible groups (all when n_group == 0): a bit per group.
        unsigned long long keep = ~0ull;
        if (n_group > 0) {
            const int per = n / n_group;
            float gs[TS_MOE_MAX_GROUPS];
            for (int g = 0; g < n_group; ++g) {
                float a = -TS_INF, b = -TS_INF;
                for (int j = g * per; j < (g + 1) * per; ++j) {
                    const float v = sel[j];
                    if (v > a) { b = a; a = v; } else if (v > b) { b = v; }
                }
                gs[g] = a + b;
            }
            keep = 0ull;
            for (int c = 0; c < topk_group; ++c) {
                int best = -1;
                for (int g = 0; g < n_group; ++g)
                    if (!((keep >> g) & 1ull) && (best < 0 || gs[g] > gs[best])) best = g;
                keep |= 1ull << best;
            }
        }
        // Top-k by repeated maximum; chosen ids collected, then sorted.
        float* out_ids = ids + r * k;
        for (int c = 0; c < k; ++c) {
            int best = -1;
            for (int j = 0; j < n; ++j) {
                if (n_group > 0 && !((keep >> (j / (n / n_group))) & 1ull)) continue;
                bool taken = false;
                for (int p = 0; p < c; ++p) taken |= ((int)out_ids[p] == j);
                if (taken) continue;
                if (best < 0 || sel[j] > sel[best]) best = j;
            }
            out_ids[c] = (float)best;
        }
        for (int a = 1; a < k; ++a)
            for (int b = a; b > 0 && out_ids[b - 1] > out_ids[b]; --b) {
                const float t = out_ids[b - 1];
                out_ids[b - 1] = out_ids[b];
                out_ids[b] = t;
            }
        float* w = weights + r * k;
        if (kind == 2) {
            float m2 = -TS_INF, s2 = 0.0f;
            for (int c = 0; c < k; ++c) m2 = fmaxf(m2, to_f32(l[(int)out_ids[c]]));
            for (int c = 0; c < k; ++c) s2 += expf(to_f32(l[(int)out_ids[c]]) - m2);
            for (int c = 0; c < k; ++c) w[c] = expf(to_f32(l[(int)out_ids[c]]) - m2) / s2;
        } else {
            float s = 0.0f;
            for (int c = 0; c < k; ++c) {
                w[c] = moe_raw(l, (int)out_ids[c], kind, mx, sum);
                s += w[c];
            }
            if (norm)
                for (int c = 0; c < k; ++c) w[c] = w[c] / s;
        }
        for (int c = 0; c < k; ++c) w[c] = w[c] * scaling;
    }
}

template <typename T>
__device__ __forceinline__ void moe_gather(const T* src, T* dst, const int* idx, int m, int width) {
    const long long total = (long long)m * width;
    TS_GRID_LOOP(i, total) {
        const long long r = i / width, c = i % width;
        dst[i] = src[(long long)idx[r] * width + c];
    }
}

template <typename T>
__device__ __forceinline__ void moe_accumulate(const T* y, const int* idx, const float* w, float* acc, int m,
                                               int width) {
    const long long total = (long long)m * width;
    TS_GRID_LOOP(i, total) {
        const long long r = i / width, c = i % width;
        float* a = acc + (long long)idx[r] * width + c;
        *a = *a + w[r] * to_f32(y[i]);
    }
}

template <typename T>
__device__ __forceinline__ void moe_store(const float* acc, T* out, long long n) {
    TS_GRID_LOOP(i, n) { out[i] = from_f32<T>(acc[i]); }
}

template <typename T>
__device__ __forceinline__ void sigmoid_scale(const T* g, T* x, int rows, int width) {
    const long long total = (long long)rows * width;
    TS_GRID_LOOP(i, total) {
        const float gate = 1.0f / (1.0f + expf(-to_f32(g[i / width])));
        x[i] = from_f32<T>(gate * to_f32(x[i]));
    }
}

template <typename T>
__device__ __forceinline__ void swiglu_clamped(const T* gate, const T* up, T* out, long long n, float alpha,
                                               float limit) {
    TS_GRID_LOOP(i, n) {
        const float g = fminf(to_f32(gate[i]), limit);
        const float u = fminf(fmaxf(to_f32(up[i]), -limit), limit);
        const float glu = g * (1.0f / (1.0f + expf(-(g * alpha))));
        out[i] = from_f32<T>((u + 1.0f) * glu);
    }
}

#define MOE_OPS(SUFFIX, T)                                                                          \
    extern "C" __global__ void moe_route_##SUFFIX(const T* logits, const T* bias, float* probs,      \
                                                  float* ids, float* weights, int rows, int n,      \
                                                  int k, int kind, int norm, float scaling,         \
                                                  int n_group, int topk_group) {                    \
        moe_route<T>(logits, bias, probs, ids, weights, rows, n, k, kind, norm, scaling, n_group,   \
                     topk_group);                                                                   \
    }                                                                                               \
    extern "C" __global__ void moe_gather_##SUFFIX(const T* src, T* dst, const int* idx, int m,     \
                                                   int width) {                                     \
        moe_gather<T>(src, dst, idx, m, width);                                                     \
    }                                                                                               \
    extern "C" __global__ void moe_accumulate_##SUFFIX(const T* y, const int* idx, const float* w,  \
                                                       float* acc, int m, int width) {              \
        moe_accumulate<T>(y, idx, w, acc, m, width);                                                \
    }                                                                                               \
    extern "C" __global__ void moe_store_##SUFFIX(const float* acc, T* out, long long n) {          \
        moe_store<T>(acc, out, n);                                                                  \
    }                                                                                               \
    extern "C" __global__ void sigmoid_scale_##SUFFIX(const T* g, T* x, int rows, int width) {      \
        sigmoid_scale<T>(g, x, rows, width);                                                        \
    }                                                                                               \
    extern "C" __global__ void swiglu_clamped_##SUFFIX(const T* gate, const T* up, T* out,          \
                                                       long long n, float alpha, float limit) {     \
        swiglu_clamped<T>(gate, up, out, n, alpha, limit);                                          \
    }
MOE_OPS(f32, float)
MOE_OPS(f16, f16_t)
MOE_OPS(bf16, bf16_t)
