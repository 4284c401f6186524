// Attention one row at a time, each row's arithmetic fixed by the keys it sees (ops.cpp includes
// this after gemv_rows.cpp, whose vector helpers it uses, and before layer_step.cpp, which calls it
// where a layer's sizes ask: the int8 setting).
//
// Why: SDPA's result for a row depends on the rows beside it and on masked keys (its blocking), by
// an ulp or so. On exact weights that is an ulp; on int8 activations (gemv_int8.cpp) an ulp can move
// a value across a grid step, and the difference grows over the layers, so a verification step's
// logits would not be a one-token step's. Here a row's output is a function of its query and of
// the keys and values it attends, in slot order, and nothing else: a chain's or a tree's row is
// the one-token step's that sees the same slots, bit for bit.
//
// Per row and query head (its kv head: h / (q heads / kv heads), as transformers' repeat_kv):
//   s_i = (q . k_i) * scale over the visible slots i (the dot: one vector chain over d, then the
//   build's fixed horizontal sum); m = max s; p_i = exp(s_i - m) (expf below);
//   l = sum p_i (lane i % W of W partial sums, W the build's vector width, then a fixed tree);
//   out = (sum_i p_i v_i, slots in order, one fused multiply-add each) / l.
#include <limits>

#if defined(__AVX512F__)
#define MT_AW 16  // floats per vector (a macro: the code below asks the preprocessor)
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
#define MT_AW 8
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
#else
#define MT_AW 1
#endif

// exp(x) for -87 <= x <= 0 (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial,
// times 2^n); below -87, 0. One lane's operations; the AVX512 build runs the same ones on 16.
static inline float exp_le0(float x) {
    if (x < -87.0f) return 0.0f;
    const float n = std::nearbyint(x * 1.44269504088896341f);
    float r = madd(n, -0.693359375f, x);
    r = madd(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) p = madd(p, r, c);
    return std::ldexp(madd(p * r, r, r) + 1.0f, (int)n);
}

// p[i] = exp(s[i] - m) over n values padded to a multiple of MT_AW (the pad: -inf, so 0).
static void exps(float* s, int n, float m) {
#if MT_AW == 16
    for (int i = 0; i < n; i += MT_AW) {
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(m));
        const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
        const __m512 nn = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fmadd_ps(nn, _mm512_set1_ps(-0.693359375f), xc);
        r = _mm512_fmadd_ps(nn, _mm512_set1_ps(2.12194440e-4f), r);
        __m512 p = _mm512_set1_ps(1.9875691500e-4f);
        for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
        const __m512 e = _mm512_scalef_ps(p, nn);
        _mm512_storeu_ps(s + i, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), e, _mm512_setzero_ps()));
    }
#elif MT_AW == 8
    for (int i = 0; i < n; i += MT_AW) {  // exp_le0's operations on 8 lanes
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(m));
        const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
        const __m256 nn = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 r = _mm256_fmadd_ps(nn, _mm256_set1_ps(-0.693359375f), xc);
        r = _mm256_fmadd_ps(nn, _mm256_set1_ps(2.12194440e-4f), r);
        __m256 p = _mm256_set1_ps(1.9875691500e-4f);
        for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
        // times 2^n, n in [-126, 0]: the power's bits made directly (a normal float), one rounding
        // of the exact product as ldexp's
        const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nn), _mm256_set1_epi32(127)), 23);
        const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
        _mm256_storeu_ps(s + i, _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ)));
    }
#else
    for (int i = 0; i < n; ++i) s[i] = exp_le0(s[i] - m);
#endif
}

#if MT_AW == 16
// The sums of 16 vectors' lanes at once # -> [sum of a[0], ..., sum of a[15]]: a transposing tree
// whose every step treats each vector alike (a vector's sum is the same whatever its place).
static inline __m512 sums16(__m512 (&a)[16]) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; ++i)  // [a0+a2, b0+b2, a1+a3, b1+b3] per 128-bit lane
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // [x, y, z, w] per 128-bit lane: one vector's 4-lane sum each
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)  // 128-bit lanes paired: (0 + 1), (2 + 3) of each vector
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));  // in order
}
#elif MT_AW == 8
// The lane loops' tree on 8 lanes: lanes j + 4, then j + 2, then j + 1 added to lane j.
static inline float lanes8(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}
#endif

// s[i] = (q . k of slot i) * scale for n slots: per slot, MT_AW lanes of fused multiply-adds in
// feature order, then a fixed sum of the lanes (AVX512: sums16, 16 slots at a time).
static void scores(const float* q, const float* kh, const int64_t* slots, int n, int d, float scale, float* s) {
    int i = 0;
#if MT_AW == 16
    if (d % 16 == 0 && d <= 256) {
        __m512 qv[16];
        for (int e = 0; e < d / 16; ++e) qv[e] = _mm512_loadu_ps(q + 16 * e);
        for (; i < n; i += 16) {
            __m512 acc[16];
            for (int j = 0; j < 16; ++j) {
                if (i + j >= n) {
                    acc[j] = _mm512_setzero_ps();
                    continue;
                }
                const float* k = kh + slots[i + j] * d;
                acc[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
                for (int e = 1; e < d / 16; ++e) acc[j] = _mm512_fmadd_ps(qv[e], _mm512_loadu_ps(k + 16 * e), acc[j]);
            }
            alignas(64) float out[16];
            _mm512_store_ps(out, _mm512_mul_ps(sums16(acc), _mm512_set1_ps(scale)));
            std::memcpy(s + i, out, sizeof(float) * std::min(16, n - i));
        }
        return;
    }
#elif MT_AW == 8
    if (d % 8 == 0) {  // the lane loop below in registers: 8 lanes, then its tree (4, 2, 1 apart)
        for (; i < n; ++i) {
            const float* k = kh + slots[i] * d;
            __m256 acc = _mm256_setzero_ps();
            for (int e = 0; e < d; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), _mm256_loadu_ps(k + e), acc);
            s[i] = lanes8(acc) * scale;
        }
        return;
    }
#endif
    for (; i < n; ++i) {
        const float* k = kh + slots[i] * d;
        float lanes[MT_AW] = {};
        for (int e = 0; e < d; e += MT_AW)
            for (int j = 0; j < MT_AW && e + j < d; ++j) lanes[j] = madd(q[e + j], k[e + j], lanes[j]);
        for (int w = MT_AW / 2; w >= 1; w /= 2)
            for (int j = 0; j < w; ++j) lanes[j] = lanes[j] + lanes[j + w];
        s[i] = lanes[0] * scale;
    }
}

// p[i] = exp(s[i] - m) in place over n values padded to a multiple of MT_AW (the pad: -inf) #
// -> their sum: lane i % MT_AW of MT_AW partial sums, then a fixed tree.
static float exp_sum(float* s, int n, float m) {
    exps(s, n, m);
#if MT_AW == 8
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += MT_AW) acc = _mm256_add_ps(acc, _mm256_loadu_ps(s + i));
    return lanes8(acc);
#else
    float lanes[MT_AW] = {};
    for (int i = 0; i < n; i += MT_AW)
        for (int j = 0; j < MT_AW; ++j) lanes[j] += s[i + j];
    for (int w = MT_AW / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; ++j) lanes[j] = lanes[j] + lanes[j + w];
    return lanes[0];
#endif
}

// One row's head: its visible ``slots`` of the kv head's buffers [cap, d] # -> out [d]; s: scratch.
static void attend_head(const float* q, const float* kh, const float* vh, const std::vector<int64_t>& slots, int d,
                        float scale, std::vector<float>& s, float* __restrict out) {
    const int n = (int)slots.size(), padded = (n + MT_AW - 1) / MT_AW * MT_AW;
    s.assign(padded, -std::numeric_limits<float>::infinity());  // the pad: exp gives 0
    scores(q, kh, slots.data(), n, d, scale, s.data());
    float m = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < n; ++i) m = std::max(m, s[i]);
    const float l = exp_sum(s.data(), padded, m);
#if MT_AW > 1  // gemv_rows.cpp's vec: MT_AW floats
    if (d % MT_AW == 0 && d <= 16 * MT_AW) {  // the loop below's fused multiply-adds, the sums in registers
        vec acc[16];
        const int w = d / MT_AW;
        for (int e = 0; e < w; ++e) acc[e] = zero();
        for (int i = 0; i < n; ++i) {
            const vec p = bcast(s[i]);
            const float* v = vh + slots[i] * d;
            for (int e = 0; e < w; ++e) acc[e] = vfma(p, load(v + MT_AW * e), acc[e]);
        }
        for (int e = 0; e < w; ++e) store(out + MT_AW * e, vdiv(acc[e], bcast(l)));
        return;
    }
#endif
    std::fill(out, out + d, 0.0f);
    for (int i = 0; i < n; ++i) {
        const float p = s[i];
        const float* __restrict v = vh + slots[i] * d;
        for (int e = 0; e < d; ++e) out[e] = madd(p, v[e], out[e]);
    }
    for (int e = 0; e < d; ++e) out[e] = out[e] / l;
}

// Rows q [T, q_heads, d] against the cache buffers [kv_heads, cap, d] # -> out [T, q_heads, d].
// Row t sees the slots 0..past-1 and, of past..past+T-1, those mask[t] marks (mask [T, past + T]
// bool, or none: T == 1, every slot to past). Rows and heads split over the threads, each one
// whole in one thread: the same bits on any thread count.
static void attend_rows(const float* q, const float* k_buf, const float* v_buf, int64_t cap, int64_t past, int T,
                        const bool* mask, int q_heads, int kv_heads, int d, float scale, float* out) {
    std::vector<std::vector<int64_t>> slots(T);
    for (int t = 0; t < T; ++t) {
        slots[t].reserve(past + T);
        for (int64_t j = 0; j < past + T; ++j)
            if (j < past || (mask ? mask[(int64_t)t * (past + T) + j] : j == past)) slots[t].push_back(j);
    }
    const int group = q_heads / kv_heads, count = T * q_heads;
    const int threads = std::min(omp_get_max_threads(), count);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<float> s;
#pragma omp for schedule(static)
        for (int i = 0; i < count; ++i) {
            const int t = i / q_heads, h = i % q_heads;
            const int64_t kv = (int64_t)(h / group) * cap * d;
            attend_head(q + (int64_t)i * d, k_buf + kv, v_buf + kv, slots[t], d, scale, s, out + (int64_t)i * d);
        }
    }
}
