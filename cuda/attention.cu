// Causal grouped-query attention of one step's queries over the KV cache, as the
// CPU engine's `attention::attend` (HF eager attention):
//   scores[j] = (q_t . k_j) * scale          for keys first <= j < visible = pos0 + t + 1
// first = 0, or for a local (sliding-window) layer, window > 0, the window's start
// max(0, visible - window): keys at positions p - window < j <= p (Gemma 3).
//   p = softmax(scores)  in f32: max, exp(x - max), sum, multiply by 1/sum
//   ctx[t, h, :] = sum_j p[j] * v_j
// Layouts: q [T, H, D] (after RoPE); k_cache, v_cache [S_cap, KV, D] holding at
// least S = pos0 + T positions (keys after RoPE); ctx [T, H*D]; probs and
// scores [H, T, S].
// GQA: query head h reads KV head h / (H / KV) (HF's repeat_kv).
// probs may be NULL: the softmax is then only kept in shared memory (written
// to global memory only when the `attn_probs` stage is tapped). When written,
// masked entries (j < first or j >= visible) are written as exact zeros. scores (the
// `attn_scores` stage: the scaled scores, the softmax input) likewise: NULL
// unless tapped, masked entries exact zeros.
// causal = 0 (the vision tower's bidirectional attention): every row sees all
// S keys (visible = s, no window); the LM passes causal = 1.
// sinks (gpt-oss; NULL: none): per query head a logit that joins the row's max
// and sum, last, as the CPU engine's and HF's `cat([scores, sinks])`, and has
// no value: its probability is dropped, so the row sums to less than 1.
// Launch: grid (T, H) for prefill, (H) for decode; blockDim a multiple of 32;
// dynamic shared memory (D + S) floats (q row, then the S scores).

template <typename T>
__device__ __forceinline__ void attend_row(const T* q, const T* k_cache, const T* v_cache,
                                           float* scores, float* probs, T* ctx, int rows,
                                           int heads,
                                           int kv_heads, int head_dim, int pos0, int s, float scale,
                                           int window, int causal, const T* sinks, int t, int h) {
    extern __shared__ float smem[];
    __shared__ float scratch[32];
    float* qs = smem;
    float* sc = smem + head_dim;
    const int kvh = h / (heads / kv_heads);
    const long long kv_row = (long long)kv_heads * head_dim;
    const T* qrow = q + ((long long)t * heads + h) * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) qs[i] = to_f32(qrow[i]);
    __syncthreads();

    const int visible = causal ? pos0 + t + 1 : s;  // <= s, checked on the host
    const int first = window > 0 && visible > window ? visible - window : 0;
    const float sink = sinks != 0 ? to_f32(sinks[h]) : -TS_INF;
    float mx = sink;
    for (int j = first + threadIdx.x; j < visible; j += blockDim.x) {
        const T* krow = k_cache + (long long)j * kv_row + (long long)kvh * head_dim;
        float dot = 0.0f;
        for (int i = 0; i < head_dim; ++i) dot += qs[i] * to_f32(krow[i]);
        const float x = dot * scale;
        sc[j] = x;
        mx = fmaxf(mx, x);
    }
    if (scores != 0) {
        // Each thread writes the entries it computed above (no barrier needed).
        float* srow = scores + ((long long)h * rows + t) * s;
        for (int j = first + threadIdx.x; j < visible; j += blockDim.x) srow[j] = sc[j];
        for (int j = threadIdx.x; j < first; j += blockDim.x) srow[j] = 0.0f;
        for (int j = visible + threadIdx.x; j < s; j += blockDim.x) srow[j] = 0.0f;
    }
    mx = block_max(mx, scratch);
    float sum = 0.0f;
    for (int j = first + threadIdx.x; j < visible; j += blockDim.x) {
        const float e = expf(sc[j] - mx);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    if (sinks != 0) sum += expf(sink - mx);
    const float inv = 1.0f / sum;
    for (int j = first + threadIdx.x; j < visible; j += blockDim.x) sc[j] *= inv;
    if (probs != 0) {
        float* prow = probs + ((long long)h * rows + t) * s;
        for (int j = first + threadIdx.x; j < visible; j += blockDim.x) prow[j] = sc[j];
        for (int j = threadIdx.x; j < first; j += blockDim.x) prow[j] = 0.0f;
        for (int j = visible + threadIdx.x; j < s; j += blockDim.x) prow[j] = 0.0f;
    }
    __syncthreads();  // every score is final before any thread reads all of them

    T* crow = ctx + ((long long)t * heads + h) * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        const T* vcol = v_cache + (long long)kvh * head_dim + i;
        float acc = 0.0f;
        for (int j = first; j < visible; ++j) acc += sc[j] * to_f32(vcol[(long long)j * kv_row]);
        crow[i] = from_f32<T>(acc);
    }
}

#define ATTENTION_OPS(SUFFIX, T)                                                              \
    extern "C" __global__ void attention_prefill_##SUFFIX(                                    \
        const T* q, const T* k_cache, const T* v_cache, float* scores, float* probs, T* ctx,    \
        int rows, int heads, int kv_heads, int head_dim, int pos0, int s, float scale,         \
        int window, int causal, const T* sinks) {                                             \
        attend_row<T>(q, k_cache, v_cache, scores, probs, ctx, rows, heads, kv_heads, head_dim, \
                      pos0, s, scale, window, causal, sinks, blockIdx.x, blockIdx.y);          \
    }                                                                                         \
    extern "C" __global__ void attention_decode_##SUFFIX(                                     \
        const T* q, const T* k_cache, const T* v_cache, float* scores, float* probs, T* ctx,    \
        int heads, int kv_heads, int head_dim, int pos0, int s, float scale, int window,       \
        int causal, const T* sinks) {                                                         \
        attend_row<T>(q, k_cache, v_cache, scores, probs, ctx, 1, heads, kv_heads, head_dim,   \
                      pos0, s, scale, window, causal, sinks, 0, blockIdx.x);                   \
    }
ATTENTION_OPS(f32, float)
ATTENTION_OPS(f16, f16_t)
ATTENTION_OPS(bf16, bf16_t)
