// The multi-row GEMV over column blocks of L outputs (gemv_rows.py builds it, through ops.cpp, which
// includes this file and registers the torch ops): float32 blocks, the argmax screen's int8 blocks,
// and the exact narrow formats of gguf_codes.py (Q4_1 / Q8_0 codes, 16-bit floats). No torch here:
// raw rows in, raw rows out; ops.cpp checks shapes, dtypes and formats before anything runs.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <type_traits>
#include <omp.h>
#ifdef __AVX512F__
constexpr int L = 32, MB = 12;  // outputs per block, rows per register block: 24 zmm of sums
#else
constexpr int L = 16, MB = 4;  // AVX2: 8 ymm of sums
#endif
constexpr int PREFETCH = 8192;  // bytes ahead of the weight read
// The float blocks' prefetch. Where GCC tunes for AMD Zen: into L2, as far ahead as R rows' work
// lets the read run (the L1 hint left larger row blocks waiting on memory there); elsewhere the L1 hint.
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
template <int R> constexpr int float_ahead() { return R <= 2 ? 4096 : R <= 6 ? 8192 : 6144; }
constexpr int FLOAT_LOCALITY = 2;
#else
template <int R> constexpr int float_ahead() { return PREFETCH; }
constexpr int FLOAT_LOCALITY = 3;
#endif

// a * b + c, fused (one rounding) wherever the CPU has FMA. Spelled out, not left to the
// compiler: whether it contracts a * b + c depends on the loop and the tuning (GCC's znver
// tuning avoids FMA chains in reductions such as argmax_prefilter.cpp's exact_at), and every chain here must round
// the same way for the screen's exact recount and the rows' logits to agree bit for bit.
static inline float madd(float a, float b, float c) {
#ifdef __FMA__
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

// The screen's int8 block: each feature's L weights converted once to two float vectors (the
// compiler would convert them once per row), then the same fused multiply-adds as the float kernel.
#if defined(__AVX512F__)
using vec = __m512;  // L / 2 floats
static inline vec cvt8(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline vec bcast(float v) { return _mm512_set1_ps(v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec zero() { return _mm512_setzero_ps(); }
static inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec load(const float* p) { return _mm512_loadu_ps(p); }
#define SCREEN_VECTORS 1
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
static inline vec cvt8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline vec bcast(float v) { return _mm256_set1_ps(v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec zero() { return _mm256_setzero_ps(); }
static inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec load(const float* p) { return _mm256_loadu_ps(p); }
#define SCREEN_VECTORS 1
#endif

// One input feature k of R rows: sums[m] += x[m, k] * w, one fused multiply-add per row and
// output, in feature order (every block below).
#ifdef SCREEN_VECTORS
template <int R>
static inline void zero_rows(vec (&acc)[R][2]) {
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = zero();
}
template <int R>
static inline void add_feature(vec (&acc)[R][2], const float* x, int K, int k, vec w0, vec w1) {
    for (int m = 0; m < R; ++m) {
        const vec xv = bcast(x[(int64_t)m * K + k]);
        acc[m][0] = vfma(xv, w0, acc[m][0]);
        acc[m][1] = vfma(xv, w1, acc[m][1]);
    }
}
template <int R>
static inline void store_rows(vec (&acc)[R][2], float (&sums)[R][L]) {
    for (int m = 0; m < R; ++m) store(sums[m], acc[m][0]), store(sums[m] + L / 2, acc[m][1]);
}
#endif
template <int R>
static inline void add_feature_plain(float (&sums)[R][L], const float* x, int K, int k, const float* wf) {
    for (int m = 0; m < R; ++m)
        for (int j = 0; j < L; ++j) sums[m][j] = madd(x[(int64_t)m * K + k], wf[j], sums[m][j]);
}
// The block's R rows of L sums into out [M, N] at column n0 (the last block may be partial).
template <int R>
static inline void write_rows(const float (&sums)[R][L], float* out, int N, int n0) {
    const int width = std::min(L, N - n0);
    for (int m = 0; m < R; ++m) std::memcpy(out + (int64_t)m * N + n0, sums[m], sizeof(float) * width);
}

// Exact grids (Q4_1 / Q8_0 codes, read as they were stored): per column block, chunks of QK
// features, each [d: L halves][m: L halves, Q4 only][codes: QK x (L/2 bytes, Q4: byte j holds
// outputs j and j + L/2 in its low and high nibble) or QK x L int8 (Q8)].
constexpr int QK = 32;
struct Q4 {};
struct Q8 {};
struct BF16 {};  // 16-bit floats, one per weight in the float blocks' layout [N / L, K, L]
struct F16 {};
static inline float half_to_float(uint16_t h) {  // exact; for the plain build (no F16C)
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    float v = exp == 0 ? std::ldexp((float)man, -24) : exp == 31 ? (man ? NAN : INFINITY) : std::ldexp((float)(man | 1024), (int)exp - 25);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    bits |= sign;
    std::memcpy(&v, &bits, 4);
    return v;
}
#if defined(__AVX512F__)
static inline vec halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline void nibbles(const uint8_t* p, vec& lo, vec& hi) {
    // a 16-entry table lookup (vpermps reads an index's low 4 bits): no mask, no conversion
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    lo = _mm512_permutexvar_ps(v, codes);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), codes);
}
static inline vec bf16s(const uint8_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#define GRID_VECTORS 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline vec halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline void nibbles(const uint8_t* p, vec& lo, vec& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
static inline vec bf16s(const uint8_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#define GRID_VECTORS 1
#endif

// Bytes of one chunk of QK features for a column block, per weight type.
template <typename W> constexpr int64_t chunk_bytes() { return std::is_same<W, Q4>::value ? 20 * L : 34 * L; }

// 16-bit floats widen exactly (bfloat16: the high half of a float32): the float kernel's chain.
template <typename W, int R>
static inline void half_block(const float* __restrict x, const uint8_t* __restrict wb, float* __restrict out,
                              int K, int N, int n0) {
    constexpr bool bf = std::is_same<W, BF16>::value;
    constexpr int H = L / 2;
    float sums[R][L] = {};
#ifdef GRID_VECTORS
    vec acc[R][2];
    zero_rows<R>(acc);
    for (int k = 0; k < K; ++k) {
        const uint8_t* p = wb + (int64_t)k * L * 2;
        __builtin_prefetch((const char*)p + PREFETCH, 0, 3);
        const vec w0 = bf ? bf16s(p) : halves(p), w1 = bf ? bf16s(p + H * 2) : halves(p + H * 2);
        add_feature<R>(acc, x, K, k, w0, w1);
    }
    store_rows<R>(acc, sums);
#else
    for (int k = 0; k < K; ++k) {
        float wf[L];
        for (int j = 0; j < L; ++j) {
            uint16_t h;
            std::memcpy(&h, wb + ((int64_t)k * L + j) * 2, 2);
            uint32_t bits = (uint32_t)h << 16;
            if (bf) std::memcpy(&wf[j], &bits, 4);
            else wf[j] = half_to_float(h);
        }
        add_feature_plain<R>(sums, x, K, k, wf);
    }
#endif
    write_rows<R>(sums, out, N, n0);
}

// R rows' sums of L outputs from grid codes: each feature's L weights decoded exactly (d q + m,
// d q exact in fp32), then the float kernel's fused multiply-adds in the same order, so the
// logits are bit-identical to the float blocks' of the same weights.
template <typename W, int R>
static inline void grid_block(const float* __restrict x, const uint8_t* __restrict wb, float* __restrict out,
                              int K, int N, int n0) {
    constexpr bool q4 = std::is_same<W, Q4>::value;
    constexpr int H = L / 2;
    float sums[R][L] = {};
#ifdef GRID_VECTORS
    vec acc[R][2];
    zero_rows<R>(acc);
    for (int t = 0; t < K / QK; ++t) {
        const uint8_t* c = wb + t * chunk_bytes<W>();
        const vec d0 = halves(c), d1 = halves(c + H * 2);
        const vec m0 = q4 ? halves(c + L * 2) : zero(), m1 = q4 ? halves(c + L * 2 + H * 2) : zero();
        const uint8_t* codes = c + (q4 ? 4 * L : 2 * L);
        for (int i = 0; i < QK; ++i) {
            const int k = t * QK + i;
            vec w0, w1;
            if constexpr (q4) {
                const uint8_t* p = codes + i * H;
                __builtin_prefetch((const char*)p + PREFETCH, 0, 3);
                nibbles(p, w0, w1);
                w0 = vfma(w0, d0, m0), w1 = vfma(w1, d1, m1);
            } else {
                const int8_t* p = (const int8_t*)codes + i * L;
                __builtin_prefetch((const char*)p + PREFETCH, 0, 3);
                w0 = vmul(cvt8(p), d0), w1 = vmul(cvt8(p + H), d1);
            }
            add_feature<R>(acc, x, K, k, w0, w1);
        }
    }
    store_rows<R>(acc, sums);
#else  // plain loops
    for (int t = 0; t < K / QK; ++t) {
        const uint8_t* c = wb + t * chunk_bytes<W>();
        float d[L], mn[L];
        for (int j = 0; j < L; ++j) {
            uint16_t h;
            std::memcpy(&h, c + 2 * j, 2);
            d[j] = half_to_float(h);
            std::memcpy(&h, c + 2 * L + 2 * j, 2);
            mn[j] = q4 ? half_to_float(h) : 0.0f;
        }
        const uint8_t* codes = c + (q4 ? 4 * L : 2 * L);
        for (int i = 0; i < QK; ++i) {
            float wf[L];
            for (int j = 0; j < L; ++j) {
                const float q = q4 ? (float)((codes[i * H + j % H] >> (j < H ? 0 : 4)) & 15) : (float)(int8_t)codes[i * L + j];
                wf[j] = d[j] * q + mn[j];  // d q is exact: one rounding, as d q + m fused
            }
            const int k = t * QK + i;
            add_feature_plain<R>(sums, x, K, k, wf);
        }
    }
#endif
    write_rows<R>(sums, out, N, n0);
}

#if defined(GRID_VECTORS) && !defined(__AVX512F__)
// AVX2, one row of Q4 codes: two column blocks side by side (``stride`` bytes apart), each output's
// chain grid_block's (one fused multiply-add per feature, in order). One block's two chains leave
// the fused multiply-adds waiting on each other's latency; four keep them busy.
static inline void q4_pair(const float* __restrict x, const uint8_t* __restrict wb, int64_t stride,
                           float* __restrict out, int K, int N, int n0) {
    constexpr int H = L / 2;
    vec acc[2][2] = {{zero(), zero()}, {zero(), zero()}};
    for (int t = 0; t < K / QK; ++t) {
        vec d[2][2], mn[2][2];
        const uint8_t* codes[2];
        for (int c = 0; c < 2; ++c) {
            const uint8_t* ch = wb + c * stride + t * chunk_bytes<Q4>();
            d[c][0] = halves(ch), d[c][1] = halves(ch + H * 2);
            mn[c][0] = halves(ch + L * 2), mn[c][1] = halves(ch + L * 2 + H * 2);
            codes[c] = ch + 4 * L;
        }
        for (int i = 0; i < QK; ++i) {
            const vec xv = bcast(x[t * QK + i]);
            for (int c = 0; c < 2; ++c) {
                const uint8_t* q = codes[c] + i * H;
                __builtin_prefetch((const char*)q + PREFETCH, 0, 3);
                vec w0, w1;
                nibbles(q, w0, w1);
                acc[c][0] = vfma(xv, vfma(w0, d[c][0], mn[c][0]), acc[c][0]);
                acc[c][1] = vfma(xv, vfma(w1, d[c][1], mn[c][1]), acc[c][1]);
            }
        }
    }
    for (int c = 0; c < 2; ++c) {
        float sums[1][L];
        store(sums[0], acc[c][0]), store(sums[0] + H, acc[c][1]);
        write_rows<1>(sums, out, N, n0 + c * L);
    }
}
#define Q4_PAIRS 1
#endif

template <int R>
static inline void q8_block(const float* __restrict x, const int8_t* __restrict wb, const float* __restrict scale,
                            float* __restrict out, int K, int N, int n0) {
    float sums[R][L] = {};
#ifdef SCREEN_VECTORS
    constexpr int H = L / 2;
    vec acc[R][2];
    zero_rows<R>(acc);
    for (int k = 0; k < K; ++k) {
        const int8_t* w = wb + (int64_t)k * L;
        __builtin_prefetch((const char*)w + PREFETCH, 0, 3);
        const vec w0 = cvt8(w), w1 = cvt8(w + H);
        add_feature<R>(acc, x, K, k, w0, w1);
    }
    store_rows<R>(acc, sums);
#else  // no AVX2: plain loops
    for (int k = 0; k < K; ++k) {
        float wf[L];
        for (int j = 0; j < L; ++j) wf[j] = (float)wb[(int64_t)k * L + j];
        add_feature_plain<R>(sums, x, K, k, wf);
    }
#endif
    const int width = std::min(L, N - n0);
    for (int m = 0; m < R; ++m)
        for (int j = 0; j < width; ++j) out[(int64_t)m * N + n0 + j] = sums[m][j] * scale[n0 + j];
}

// The exact kernel's block: R rows' sums of L outputs, one fused multiply-add per feature in order.
template <int R>
static inline void rows_block(const float* __restrict x, const float* __restrict wb, float* __restrict out,
                              int K, int N, int n0) {
    float sums[R][L] = {};
#ifdef SCREEN_VECTORS
    constexpr int H = L / 2;
    vec acc[R][2];
    zero_rows<R>(acc);
    for (int k = 0; k < K; ++k) {
        const float* w = wb + (int64_t)k * L;
        __builtin_prefetch((const char*)w + float_ahead<R>(), 0, FLOAT_LOCALITY);
        __builtin_prefetch((const char*)w + float_ahead<R>() + 64, 0, FLOAT_LOCALITY);
        add_feature<R>(acc, x, K, k, load(w), load(w + H));
    }
    store_rows<R>(acc, sums);
#else
    for (int k = 0; k < K; ++k) add_feature_plain<R>(sums, x, K, k, wb + (int64_t)k * L);
#endif
    write_rows<R>(sums, out, N, n0);
}

// W: float (the exact kernel) or int8_t (the argmax screen's copy, times a scale per output)
template <typename W, int R>
static inline void block(const float* x, const W* wb, const float* scale, float* out, int K, int N, int n0) {
    if constexpr (std::is_same<W, int8_t>::value) {
        q8_block<R>(x, wb, scale, out, K, N, n0);
    } else if constexpr (std::is_same<W, float>::value) {
        rows_block<R>(x, wb, out, K, N, n0);
    } else if constexpr (std::is_same<W, BF16>::value || std::is_same<W, F16>::value) {
        half_block<W, R>(x, (const uint8_t*)wb, out, K, N, n0);
    } else {
        grid_block<W, R>(x, (const uint8_t*)wb, out, K, N, n0);
    }
}

// Bytes of one column block of K features.
template <typename W> static inline int64_t column_bytes(int K) {
    if constexpr (std::is_same<W, float>::value || std::is_same<W, int8_t>::value) return (int64_t)K * L * sizeof(W);
    else if constexpr (std::is_same<W, BF16>::value || std::is_same<W, F16>::value) return (int64_t)K * L * 2;
    else return (int64_t)(K / QK) * chunk_bytes<W>();
}

// f(R, m) for the rows m .. m + R - 1 of M: blocks of B rows, then one block of the rest (R a
// compile-time constant, std::integral_constant, so each row count gets its own unrolled block).
template <int R, typename F>
static inline void rest_rows(int r, int m, F& f) {
    if constexpr (R > 0) {
        if (r == R) f(std::integral_constant<int, R>{}, m);
        else rest_rows<R - 1>(r, m, f);
    }
}
template <int B, typename F>
static inline void row_blocks(int M, F&& f) {
    int m = 0;
    for (; m + B <= M; m += B) f(std::integral_constant<int, B>{}, m);
    rest_rows<B - 1>(M - m, m, f);
}

template <typename W>
static void column_block(const float* x, const W* wb, const float* scale, float* out, int M, int K, int N, int n0) {
    row_blocks<MB>(M, [&](auto rows, int m) {
        block<W, decltype(rows)::value>(x + (int64_t)m * K, wb, scale, out + (int64_t)m * N, K, N, n0);
    });
}


template <typename W>
static void blocks(const float* x, const W* wp, const float* scale, float* out, int M, int K, int N) {
    const int count = (N + L - 1) / L;
#ifdef Q4_PAIRS
    if constexpr (std::is_same<W, Q4>::value) {
        if (M == 1) {  // a one-token step: the blocks in pairs (q4_pair), an odd last one alone
            const int64_t stride = column_bytes<W>(K);
            const int pairs = count / 2, threads = std::min(omp_get_max_threads(), std::max(pairs, 1));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
            for (int b = 0; b < pairs; ++b)
                q4_pair(x, (const uint8_t*)wp + 2 * b * stride, stride, out, K, N, 2 * b * L);
            if (count % 2)
                column_block<W>(x, (const W*)((const char*)wp + (count - 1) * stride), scale, out, M, K, N, (count - 1) * L);
            return;
        }
    }
#endif
    const int threads = std::min(omp_get_max_threads(), count);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int b = 0; b < count; ++b)
        column_block<W>(x, (const W*)((const char*)wp + b * column_bytes<W>(K)), scale, out, M, K, N, b * L);
}

static int rows_lanes() { return L; }

// x [M, K], wp [ceil(N / L), K, L] (zero-padded past N), out [M, N]
static void rows_linear(const float* x, const float* wp, float* out, int M, int K, int N) {
    blocks<float>(x, wp, nullptr, out, M, K, N);
}

// x [M, K] times a narrow format's blocks -> out [M, N] (ops.cpp has checked the format, the
// shapes and K % QK for the codes).
template <typename W>
static void narrow_linear(const float* x, const uint8_t* wp, float* out, int M, int K, int N) {
    blocks<W>(x, (const W*)wp, nullptr, out, M, K, N);
}

// The screen's logits alone: x [M, K] times the int8 blocks q, each output times its scale.
static void rows_screened(const float* x, const int8_t* q, const float* scale, float* out, int M, int K, int N) {
    blocks<int8_t>(x, q, scale, out, M, K, N);
}
