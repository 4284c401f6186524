// Q4_1 and Q8_0 codes times int8 activations: the ``rows-q8`` setting's kernels (ops.cpp includes this after
// gemv_rows.cpp: its L, QK, chunk layout and helpers). Not exact, by design: the rows are first
// put on ggml's Q8_1 grid, as llama.cpp's own Q4_1 kernels put them, so a chunk's 32 products are
// integer dot products (VNNI: 64 per instruction) instead of 32 fused multiply-adds per row.
//
// Per row and chunk of QK inputs: a = max |x|, d = a / 127, q = round(x * (127 / a)) in -127..127
// (nearest, ties to even), s = d * sum q; then per output, with the chunk's w = d_w q_w + m_w,
//   isum = sum q_w q   (exact in int32)
//   acc = fma(float(isum), d_w * d, acc); acc = fma(m_w, s, acc)        (chunks in order)
// so x w ~ d_w d isum + m_w s, off by at most sum over chunks of (d / 2) sum |w| plus float rounding
// (Q8_0, w = d_w q_w: the first fused multiply-add alone).
// Every row's arithmetic is that sequence whatever the row count, its place in the call and the
// thread count: a verification step's logits are a one-token step's, bit for bit, on this setting.
// The integers are exact on every build; the plain build rounds the fold's products apart where it
// has no FMA (as gemv_rows.cpp's madd does).

#include <vector>

// Row scratch: each row's codes [M, K] and per chunk d, s and the codes' sum n [M, K / QK].
struct Q8Rows {
    const int8_t* q;
    const float* d;
    const float* s;
    const int32_t* n;
    Q8Rows at(int64_t m, int K) const {  // from row m on
        const int64_t c = m * (K / QK);
        return {q + m * K, d + c, s + c, n + c};
    }
};

// One chunk of QK inputs onto the grid (a non-finite input: d and s NaN, codes 0, so the logits are
// NaN, as the exact kernel's are not finite there either).
static inline void quantize_chunk(const float* x, int8_t* q, float* d, float* s, int32_t* n) {
    float a = 0.0f;
    bool finite = true;
    for (int i = 0; i < QK; ++i) a = std::max(a, std::fabs(x[i])), finite = finite && std::isfinite(x[i]);
    if (!finite) {
        std::memset(q, 0, QK);
        *d = *s = NAN;
        *n = 0;
        return;
    }
    const float inv = a > 0.0f ? 127.0f / a : 0.0f;
    int sum = 0;
    for (int i = 0; i < QK; ++i) {
        const int v = (int)std::nearbyint(x[i] * inv);  // |x inv| <= 127 (1 + 2u): never past 127
        q[i] = (int8_t)v;
        sum += v;
    }
    *d = a / 127.0f;
    *s = *d * (float)sum;
    *n = sum;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int Q8_ROWS = 12;  // rows per pass: 2 zmm of int sums each (the float sums in L1)
using ivec = __m512i;
// Four inputs' codes of L outputs, [input][L / 2 bytes] (gguf_codes' layout), to [output][4 inputs]
// in 32-bit lanes: dwords to 128-bit lanes by output quarter, then a 4 x 4 byte transpose in each.
static inline ivec group_codes(const uint8_t* p) {
    const ivec to_lanes = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const ivec transpose = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(to_lanes, _mm512_loadu_si512(p)), transpose);
}
static inline ivec low_nibbles(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
static inline ivec high_nibbles(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
static inline ivec izero() { return _mm512_setzero_si512(); }
static inline ivec ibcast(int32_t v) { return _mm512_set1_epi32(v); }
static inline vec to_float(ivec v) { return _mm512_cvtepi32_ps(v); }
#ifdef __AVX512VNNI__
#define Q8_DPBUSD 1
static inline ivec dot4(ivec acc, ivec u8, ivec s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
#else  // pairs to int16 (at most 2 * 15 * 127 each), summed over the chunk's 8 groups (< 2^15), then to int32
static inline ivec dot2(ivec acc, ivec u8, ivec s8) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u8, s8)); }
static inline ivec widen(ivec v) { return _mm512_madd_epi16(v, _mm512_set1_epi16(1)); }
#endif
#define Q8_VECTORS 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
constexpr int Q8_ROWS = 6;
using ivec = __m256i;
static inline ivec group_codes(const uint8_t* p) {
    const ivec to_lanes = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const ivec transpose = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                            0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)p), to_lanes), transpose);
}
static inline ivec low_nibbles(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
static inline ivec high_nibbles(ivec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
static inline ivec izero() { return _mm256_setzero_si256(); }
static inline ivec ibcast(int32_t v) { return _mm256_set1_epi32(v); }
static inline vec to_float(ivec v) { return _mm256_cvtepi32_ps(v); }
static inline ivec dot2(ivec acc, ivec u8, ivec s8) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u8, s8)); }
static inline ivec widen(ivec v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }
#define Q8_VECTORS 1
#else
constexpr int Q8_ROWS = 4;
#endif

#ifdef Q8_VECTORS
// R rows' inputs 4g .. 4g + 3 of chunk t against a group's two weight vectors (each lane: an
// output's 4 codes): isum[m][h] = dot(isum[m][h], w_h, the row's 4 codes in every lane).
template <int R, typename Dot>
static inline void add_group(ivec (&isum)[R][2], const Q8Rows& x, int K, int t, int g, ivec w0, ivec w1, Dot dot) {
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) {
        int32_t four;
        std::memcpy(&four, x.q + (int64_t)m * K + t * QK + 4 * g, 4);
        const ivec xv = ibcast(four);
        isum[m][0] = dot(isum[m][0], w0, xv), isum[m][1] = dot(isum[m][1], w1, xv);
    }
}
#endif

// R rows' L outputs of one column block: the sequence above, chunk by chunk.
template <int R>
static inline void q4_q8_block(const Q8Rows& x, const uint8_t* __restrict wb, float* __restrict out, int K, int N, int n0) {
    constexpr int H = L / 2, T = QK / 4;  // bytes per input; groups of 4 inputs per chunk
    const int chunks = K / QK;
    float sums[R][L] = {};
#ifdef Q8_VECTORS
    for (int t = 0; t < chunks; ++t) {
        const uint8_t* c = wb + t * chunk_bytes<Q4>();
        const vec d0 = halves(c), d1 = halves(c + H * 2), m0 = halves(c + L * 2), m1 = halves(c + L * 2 + H * 2);
        const uint8_t* codes = c + 4 * L;
        ivec isum[R][2];
#pragma GCC unroll 16
        for (int m = 0; m < R; ++m) isum[m][0] = isum[m][1] = izero();
#pragma GCC unroll 8
        for (int g = 0; g < T; ++g) {
            const uint8_t* p = codes + g * 4 * H;
            __builtin_prefetch((const char*)p + PREFETCH, 0, 3);
            const ivec v = group_codes(p), lo = low_nibbles(v), hi = high_nibbles(v);
#ifdef Q8_DPBUSD
            add_group<R>(isum, x, K, t, g, lo, hi, [](ivec a, ivec w, ivec q) { return dot4(a, w, q); });
#else
            add_group<R>(isum, x, K, t, g, lo, hi, [](ivec a, ivec w, ivec q) { return dot2(a, w, q); });
#endif
        }
#pragma GCC unroll 16
        for (int m = 0; m < R; ++m) {  // the float sums live in L1, updated once per chunk
            const int64_t at = (int64_t)m * chunks + t;
            const vec dx = bcast(x.d[at]), sx = bcast(x.s[at]);
#ifdef Q8_DPBUSD
            const ivec s0 = isum[m][0], s1 = isum[m][1];
#else
            const ivec s0 = widen(isum[m][0]), s1 = widen(isum[m][1]);
#endif
            store(sums[m], vfma(m0, sx, vfma(to_float(s0), vmul(d0, dx), load(sums[m]))));
            store(sums[m] + H, vfma(m1, sx, vfma(to_float(s1), vmul(d1, dx), load(sums[m] + H))));
        }
    }
#else  // plain loops: the same integers, the same fold
    for (int t = 0; t < chunks; ++t) {
        const uint8_t* c = wb + t * chunk_bytes<Q4>();
        const uint8_t* codes = c + 4 * L;
        for (int j = 0; j < L; ++j) {
            uint16_t h;
            std::memcpy(&h, c + 2 * j, 2);
            const float dw = half_to_float(h);
            std::memcpy(&h, c + 2 * L + 2 * j, 2);
            const float mw = half_to_float(h);
            for (int m = 0; m < R; ++m) {
                const int8_t* xq = x.q + (int64_t)m * K + t * QK;
                int32_t isum = 0;
                for (int i = 0; i < QK; ++i) isum += ((codes[i * H + j % H] >> (j < H ? 0 : 4)) & 15) * xq[i];
                const int64_t at = (int64_t)m * chunks + t;
                sums[m][j] = madd(mw, x.s[at], madd((float)isum, dw * x.d[at], sums[m][j]));
            }
        }
    }
#endif
    write_rows<R>(sums, out, N, n0);
}

// Q8_0 codes (w = d_w q_w, q_w in -127..127): isum = sum q_w q exact, acc = fma(float(isum), d_w * d, acc).
// VNNI multiplies unsigned by signed bytes: it takes q_w + 128 (the sign bit flipped) and subtracts
// 128 n (n = sum q) after; without it, |q_w| times q with q_w's sign (pairs < 2^15, widened per group).
#ifdef Q8_VECTORS
#if defined(__AVX512F__)
// Four inputs' codes of L = 32 outputs ([input][32 bytes]) to [output][4 inputs] in 32-bit lanes,
// two vectors; their outputs in this order (the unpacks work within 128-bit lanes):
constexpr int Q8_ORDER[2][16] = {{0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
                                 {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
static inline void q8_group(const int8_t* p, ivec& w0, ivec& w1) {
    const __m256i a = _mm256_loadu_si256((const __m256i*)p), b = _mm256_loadu_si256((const __m256i*)(p + L)),
                  c = _mm256_loadu_si256((const __m256i*)(p + 2 * L)), d = _mm256_loadu_si256((const __m256i*)(p + 3 * L));
    const __m256i ab_lo = _mm256_unpacklo_epi8(a, b), ab_hi = _mm256_unpackhi_epi8(a, b);
    const __m256i cd_lo = _mm256_unpacklo_epi8(c, d), cd_hi = _mm256_unpackhi_epi8(c, d);
    w0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(ab_lo, cd_lo)), _mm256_unpackhi_epi16(ab_lo, cd_lo), 1);
    w1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(ab_hi, cd_hi)), _mm256_unpackhi_epi16(ab_hi, cd_hi), 1);
}
static inline vec q8_scales(const uint8_t* c, int h) {  // d_w of the outputs of vector h, in its order
    return _mm512_permutex2var_ps(halves(c), _mm512_loadu_si512(Q8_ORDER[h]), halves(c + L));
}
#else  // AVX2, L = 16: the same unpacks give the outputs in order
static inline void q8_group(const int8_t* p, ivec& w0, ivec& w1) {
    const __m128i a = _mm_loadu_si128((const __m128i*)p), b = _mm_loadu_si128((const __m128i*)(p + L)),
                  c = _mm_loadu_si128((const __m128i*)(p + 2 * L)), d = _mm_loadu_si128((const __m128i*)(p + 3 * L));
    const __m128i ab_lo = _mm_unpacklo_epi8(a, b), ab_hi = _mm_unpackhi_epi8(a, b);
    const __m128i cd_lo = _mm_unpacklo_epi8(c, d), cd_hi = _mm_unpackhi_epi8(c, d);
    w0 = _mm256_set_m128i(_mm_unpackhi_epi16(ab_lo, cd_lo), _mm_unpacklo_epi16(ab_lo, cd_lo));
    w1 = _mm256_set_m128i(_mm_unpackhi_epi16(ab_hi, cd_hi), _mm_unpacklo_epi16(ab_hi, cd_hi));
}
static inline vec q8_scales(const uint8_t* c, int h) { return halves(c + h * L); }
#endif
#if defined(__AVX512F__) && !defined(Q8_DPBUSD)  // |w| and x with w's sign: AVX512BW has no sign op
static inline ivec signed_dot(ivec acc, ivec w, ivec x) {
    const __mmask64 negative = _mm512_movepi8_mask(w);
    const ivec pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w), _mm512_mask_sub_epi8(x, negative, izero(), x));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
#elif !defined(__AVX512F__)
static inline ivec signed_dot(ivec acc, ivec w, ivec x) {
    const ivec pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif
#endif

template <int R>
static inline void q8_q8_block(const Q8Rows& x, const uint8_t* __restrict wb, float* __restrict out, int K, int N, int n0) {
    constexpr int H = L / 2, T = QK / 4;
    const int chunks = K / QK;
    float sums[R][L] = {};
#ifdef Q8_VECTORS
    alignas(64) float acc[R][L] = {};  // in the groups' output order
    for (int t = 0; t < chunks; ++t) {
        const uint8_t* c = wb + t * chunk_bytes<Q8>();
        const vec d0 = q8_scales(c, 0), d1 = q8_scales(c, 1);
        const int8_t* codes = (const int8_t*)(c + 2 * L);
        ivec isum[R][2];
        for (int m = 0; m < R; ++m) isum[m][0] = isum[m][1] = izero();
#pragma GCC unroll 8
        for (int g = 0; g < T; ++g) {
            const int8_t* p = codes + g * 4 * L;
            for (int line = 0; line < 4 * L; line += 64) __builtin_prefetch((const char*)p + PREFETCH + line, 0, 3);
            ivec w0, w1;
            q8_group(p, w0, w1);
#ifdef Q8_DPBUSD
            const ivec flip = _mm512_set1_epi8((char)0x80);
            w0 = _mm512_xor_si512(w0, flip), w1 = _mm512_xor_si512(w1, flip);  // q_w + 128, as unsigned bytes
#endif
#ifdef Q8_DPBUSD
            add_group<R>(isum, x, K, t, g, w0, w1, [](ivec a, ivec w, ivec q) { return dot4(a, w, q); });
#else
            add_group<R>(isum, x, K, t, g, w0, w1, [](ivec a, ivec w, ivec q) { return signed_dot(a, w, q); });
#endif
        }
#pragma GCC unroll 16
        for (int m = 0; m < R; ++m) {
            const int64_t at = (int64_t)m * chunks + t;
            const vec dx = bcast(x.d[at]);
#ifdef Q8_DPBUSD
            const ivec shift = ibcast(128 * x.n[at]);
            const ivec s0 = _mm512_sub_epi32(isum[m][0], shift), s1 = _mm512_sub_epi32(isum[m][1], shift);
#else
            const ivec s0 = isum[m][0], s1 = isum[m][1];
#endif
            store(acc[m], vfma(to_float(s0), vmul(d0, dx), load(acc[m])));
            store(acc[m] + H, vfma(to_float(s1), vmul(d1, dx), load(acc[m] + H)));
        }
    }
    for (int m = 0; m < R; ++m)
        for (int j = 0; j < L; ++j) {
#if defined(__AVX512F__)
            sums[m][Q8_ORDER[j / H][j % H]] = acc[m][j];
#else
            sums[m][j] = acc[m][j];
#endif
        }
#else  // plain loops: the same integers, the same fold
    for (int t = 0; t < chunks; ++t) {
        const uint8_t* c = wb + t * chunk_bytes<Q8>();
        const int8_t* codes = (const int8_t*)(c + 2 * L);
        for (int j = 0; j < L; ++j) {
            uint16_t h;
            std::memcpy(&h, c + 2 * j, 2);
            const float dw = half_to_float(h);
            for (int m = 0; m < R; ++m) {
                const int8_t* xq = x.q + (int64_t)m * K + t * QK;
                int32_t isum = 0;
                for (int i = 0; i < QK; ++i) isum += codes[i * L + j] * xq[i];
                const int64_t at = (int64_t)m * chunks + t;
                sums[m][j] = madd((float)isum, dw * x.d[at], sums[m][j]);
            }
        }
    }
#endif
    write_rows<R>(sums, out, N, n0);
}

// x [M, K] (K % QK == 0) times codes W (Q4 or Q8) [ceil(N / L), K / QK, chunk bytes] -> out [M, N].
template <typename W>
static void q8_rows_linear(const float* x, const uint8_t* wp, float* out, int M, int K, int N) {
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> ds;
    thread_local std::vector<int32_t> ns;
    const int64_t chunks = (int64_t)M * (K / QK);
    if ((int64_t)q.size() < chunks * QK) q.resize(chunks * QK);
    if ((int64_t)ds.size() < 2 * chunks) ds.resize(2 * chunks), ns.resize(chunks);
    for (int64_t c = 0; c < chunks; ++c) quantize_chunk(x + c * QK, q.data() + c * QK, &ds[c], &ds[chunks + c], &ns[c]);
    const Q8Rows rows{q.data(), ds.data(), ds.data() + chunks, ns.data()};
    const int count = (N + L - 1) / L;
    const int threads = std::min(omp_get_max_threads(), count);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int b = 0; b < count; ++b) {
        const uint8_t* wb = wp + (int64_t)b * column_bytes<W>(K);
        row_blocks<Q8_ROWS>(M, [&](auto r, int m) {
            if constexpr (std::is_same<W, Q4>::value) q4_q8_block<decltype(r)::value>(rows.at(m, K), wb, out + (int64_t)m * N, K, N, b * L);
            else q8_q8_block<decltype(r)::value>(rows.at(m, K), wb, out + (int64_t)m * N, K, N, b * L);
        });
    }
}
