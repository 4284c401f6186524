// The exact argmax of Q8_0 codes' logits (a GGUF's tied unembedding) at a fraction of their
// arithmetic: a prefilter that rules out most outputs, then exact recounts. Included by ops.cpp after
// gemv_rows.cpp (one translation unit: its L, QK, chunk layout and helpers). Greedy steps need only the argmax, and on the codes the float32 chain's 2 fused
// multiply-adds per row and 32 weights set the cost of a step over several rows; VNNI's int16
// dot products do 32 products per instruction, exactly:
//   1. each row x is put on an int16 grid, x ~ s xq with s = max|x| / 32767 (|x - s xq| <= 0.51 s);
//   2. per column block and QK-feature chunk, sum xq q exactly in int32 (|sum| < 2^27), then
//      approx += d * sum in float32, times s at the end;
//   3. |approx_v - exact_v| <= bound_v = max|x| l1_v (0.51 / 32767 + (K + K / QK + 8) u), twice
//      over for the float arithmetic of the comparisons, where l1_v = sum_k |w_kv| and exact_v
//      is the grid kernel's own logit (its chain's rounding is in the (K ...) u term);
//   4. only the outputs whose approx + bound reaches the best approx - bound are recomputed by the
//      grid kernel's chain (d q exact, one fused multiply-add per feature in order): the argmax,
//      the first on ties, is that of the logits the gemv op returns for Q8_0, bit for bit.
// At the end, the same for float32 weights (``rows_argmax``): gemv_rows.cpp's int8 screen copy
// gives approximate logits, and the outputs within its bound are recounted by the float chain.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// rows per pass over the weight: 2 zmm of int sums each (the float sums, updated once per chunk,
// live in L1); fewer rows per pass than the float kernel's 12 keep those sums in registers
constexpr int SCREEN_ROWS = 6;
constexpr int XQ_MAX = 32767;

// After unpacking two features' 32 int16 weights, dword j of the low half holds output
// 8 (j / 4) + j % 4 and of the high half 4 more (the unpacks work within 128-bit lanes).
static inline __m512i unpacked_outputs(int plus) {
    return _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27), _mm512_set1_epi32(plus));
}
// Back to output order: outputs 16 h .. 16 h + 15 from the (low, high) halves (index >= 16: high).
static inline __m512i output_order(int h) {
    alignas(64) int idx[16];
    for (int i = 0; i < 16; ++i) {
        const int o = 16 * h + i, r = o % 8;
        idx[i] = r < 4 ? 4 * (o / 8) + r : 16 + 4 * (o / 8) + r - 4;
    }
    return _mm512_load_si512(idx);
}

template <int R>
static void screen_block(const int16_t* __restrict xq, const float* __restrict amax, const uint8_t* __restrict wb,
                         float* __restrict approx, int K, int N, int n0) {
    const __m512i lo_at = unpacked_outputs(0), hi_at = unpacked_outputs(4);
    alignas(64) float acc[R][L] = {};  // float sums in unpack order, updated once per chunk
    for (int t = 0; t < K / QK; ++t) {
        const uint8_t* c = wb + t * chunk_bytes<Q8>();
        const __m512 d0 = halves(c), d1 = halves(c + L);
        const __m512 dlo = _mm512_permutex2var_ps(d0, lo_at, d1), dhi = _mm512_permutex2var_ps(d0, hi_at, d1);
        const int8_t* codes = (const int8_t*)(c + 2 * L);
        __m512i sum[R][2];
        for (int m = 0; m < R; ++m) sum[m][0] = sum[m][1] = _mm512_setzero_si512();
        for (int p = 0; p < QK / 2; ++p) {  // features 2p, 2p + 1 of the chunk
            const int8_t* f = codes + 2 * p * L;
            __builtin_prefetch((const char*)f + PREFETCH, 0, 3);
            const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)f));
            const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(f + L)));
            const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
            for (int m = 0; m < R; ++m) {
                int32_t pair;
                std::memcpy(&pair, xq + (int64_t)m * K + t * QK + 2 * p, 4);
                const __m512i xv = _mm512_set1_epi32(pair);
                sum[m][0] = _mm512_dpwssd_epi32(sum[m][0], lo, xv);
                sum[m][1] = _mm512_dpwssd_epi32(sum[m][1], hi, xv);
            }
        }
        for (int m = 0; m < R; ++m) {
            _mm512_store_ps(acc[m], _mm512_fmadd_ps(dlo, _mm512_cvtepi32_ps(sum[m][0]), _mm512_load_ps(acc[m])));
            _mm512_store_ps(acc[m] + 16, _mm512_fmadd_ps(dhi, _mm512_cvtepi32_ps(sum[m][1]), _mm512_load_ps(acc[m] + 16)));
        }
    }
    const int width = std::min(L, N - n0);
    for (int m = 0; m < R; ++m) {
        alignas(64) float row[L];
        const __m512 scale = _mm512_set1_ps(amax[m] / XQ_MAX);  // the int16 grid's step
        for (int h = 0; h < 2; ++h)
            _mm512_store_ps(row + 16 * h, _mm512_mul_ps(scale, _mm512_permutex2var_ps(_mm512_load_ps(acc[m]), output_order(h), _mm512_load_ps(acc[m] + 16))));
        std::memcpy(approx + (int64_t)m * N + n0, row, sizeof(float) * width);
    }
}

static void screen_rows(const int16_t* xq, const float* amax, const uint8_t* wb, float* approx, int M, int K, int N, int n0) {
    row_blocks<SCREEN_ROWS>(M, [&](auto rows, int m) {
        screen_block<decltype(rows)::value>(xq + (int64_t)m * K, amax + m, wb, approx + (int64_t)m * N, K, N, n0);
    });
}

// The grid kernel's logit of output v for row x [K] (grid_block<Q8>'s chain, one lane of it).
static inline float grid_exact_at(const float* x, const uint8_t* wp, int K, int v) {
    const uint8_t* col = wp + (int64_t)(v / L) * (K / QK) * chunk_bytes<Q8>();
    const int j = v % L;
    float acc = 0.0f;
    for (int t = 0; t < K / QK; ++t) {
        const uint8_t* c = col + t * chunk_bytes<Q8>();
        uint16_t h;
        std::memcpy(&h, c + 2 * j, 2);
        const float d = _cvtsh_ss(h);
        const int8_t* codes = (const int8_t*)(c + 2 * L);
        for (int i = 0; i < QK; ++i) acc = madd(x[t * QK + i], (float)codes[i * L + j] * d, acc);
    }
    return acc;
}
#endif

// The argmax over N outputs of each row of x [M, K] times the Q8_0 grid wp (the first on ties),
// from the int16 screen and exact recounts. l1 [N]: sum_k |w_kv|, rounded up; xq [M, K], amax [M]
// (each row's max |x|), approx [M, N]: scratch. Returns how many outputs were recounted, -1 if x is not finite or a
// recount is not, -2 where this build has no AVX512-VNNI (the caller takes the logits' argmax).
static int64_t q8_argmax(const float* x, const uint8_t* wp, const float* l1, int16_t* xq, float* amax,
                               float* approx, int64_t* best, int M, int K, int N) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (K % QK != 0) return -2;
    for (int m = 0; m < M; ++m) {
        const float* xr = x + (int64_t)m * K;
        amax[m] = 0.0f;
        for (int k = 0; k < K; ++k) amax[m] = std::max(amax[m], std::fabs(xr[k]));
        if (!std::isfinite(amax[m])) return -1;
        const float inv = amax[m] > 0.0f ? XQ_MAX / amax[m] : 0.0f;
        for (int k = 0; k < K; ++k) xq[(int64_t)m * K + k] = (int16_t)std::max(-XQ_MAX, std::min(XQ_MAX, (int)std::lrintf(xr[k] * inv)));
    }
    const int count = (N + L - 1) / L;
    const int threads = std::min(omp_get_max_threads(), count);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int b = 0; b < count; ++b)
        screen_rows(xq, amax, wp + (int64_t)b * (K / QK) * chunk_bytes<Q8>(), approx, M, K, N, b * L);
    constexpr float u = FLT_EPSILON / 2;
    int64_t picked = 0;
    for (int m = 0; m < M; ++m) {
        const float* xr = x + (int64_t)m * K;
        const float* a = approx + (int64_t)m * N;
        const float beta = 2.0f * amax[m] * (0.51f / XQ_MAX + (K + K / QK + 8) * u);
        float lo = -INFINITY;
        for (int v = 0; v < N; ++v) lo = std::max(lo, a[v] - beta * l1[v]);
        float top = 0.0f;
        int64_t at = -1;
        for (int v = 0; v < N; ++v) {
            if (a[v] + beta * l1[v] < lo) continue;
            const float e = grid_exact_at(xr, wp, K, v);
            if (!std::isfinite(e)) return -1;
            ++picked;
            if (at < 0 || e > top) top = e, at = v;
        }
        best[m] = at;
    }
    return picked;
#else
    (void)x, (void)wp, (void)l1, (void)xq, (void)amax, (void)approx, (void)best, (void)M, (void)K, (void)N;
    return -2;
#endif
}

// Whether this build has the screen (AVX512-VNNI): callers skip its scratch where it has not.
static bool prefilter_built() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return true;
#else
    return false;
#endif
}

// The float32 blocks' screened argmax (gemv_rows.cpp's int8 screen copy, then exact recounts).
// The exact kernel's logit of output v for row x [K]: the same chain, one product per feature in order.
static inline float exact_at(const float* x, const float* wp, int K, int v) {
    const float* w = wp + (int64_t)(v / L) * K * L + v % L;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc = madd(x[k], w[(int64_t)k * L], acc);
    return acc;
}

// The exact kernel's argmax over N outputs of each row of x [M, K] (the first on ties), reading the
// int8 copy q [ceil(N / L), K, L] (times scale [N]) in full and the fp32 blocks wp only at the
// outputs whose screened value, within err[n] * |x|_1 of its exact one, can reach the best.
// approx [M, N]: scratch. Returns how many outputs were computed exactly, or -1 if x is not finite.
static int64_t rows_argmax(const float* x, const int8_t* q, const float* scale, const float* err,
                               const float* wp, float* approx, int64_t* best, int M, int K, int N) {
    blocks<int8_t>(x, q, scale, approx, M, K, N);
    int64_t picked = 0;
    for (int m = 0; m < M; ++m) {
        const float* xr = x + (int64_t)m * K;
        const float* a = approx + (int64_t)m * N;
        double l1 = 0.0;
        for (int k = 0; k < K; ++k) l1 += std::fabs((double)xr[k]);
        const float s = (float)(l1 * (1.0 + 4.0 * FLT_EPSILON));  // |x|_1, rounded up
        float lo = -INFINITY, big = 0.0f;  // lo: the best screened value less its bound; no exact maximum lies below it
#pragma omp simd reduction(max : lo, big)
        for (int v = 0; v < N; ++v) {
            lo = std::max(lo, a[v] - s * err[v]);
            big = std::max(big, std::fabs(a[v]) + s * err[v]);
        }
        if (!std::isfinite(s) || !std::isfinite(big)) return -1;
        const float floor = lo - 4.0f * FLT_EPSILON * big;  // both sides' float rounding (each <= 2 eps big) with room
        float top = 0.0f;
        int64_t at = -1;
        for (int v = 0; v < N; ++v) {
            if (a[v] + s * err[v] < floor) continue;
            const float e = exact_at(xr, wp, K, v);
            if (std::isnan(e)) return -1;
            ++picked;
            if (at < 0 || e > top) top = e, at = v;
        }
        best[m] = at;
    }
    return picked;
}
