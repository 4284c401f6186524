// Each row's first maximum, as ``x.max(-1).indices`` picks it, and each row's k largest values
// (ops.cpp includes this after row_attention.cpp, whose ``MT_AW`` it uses).
//
// Why: greedy decoding reads only each row's argmax, and torch's max with indices walks bfloat16
// logits one value at a time; a distillation step's [256, 49152] logits take it several times
// the time reading them once takes. Here each row is read once in vectors: per lane the largest
// value and its first index (a later equal value does not replace it), then the lanes' largest
// and, among the lanes that hold it, the smallest index. torch's rule, exactly: a row with a NaN
// gives its first NaN; otherwise the first index of the largest value (-0 and +0 are equal).
//
// Sampling's top-k reads a row's k largest values; torch's CPU top-k copies every (value, index)
// pair of the row and partial-sorts them. Here a row is read twice in vectors (block maxima, then
// the values at or above a floor they give) and only those few values are ranked.
// The rule (decoding/sampling.py's ``top_k_rows``, whose torch fallback computes the same): the k
// largest, largest first, equal values by lower index first (torch orders ties as its partial
// sort leaves them); a row with a NaN ranks its NaNs first, by index, as larger than any value.
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

namespace {

template <typename T>
int64_t first_max_plain(const T* x, int64_t n) {
    int64_t best = 0;
    float top = static_cast<float>(x[0]);
    if (std::isnan(top)) return 0;
    for (int64_t i = 1; i < n; ++i) {
        const float v = static_cast<float>(x[i]);
        if (std::isnan(v)) return i;
        if (v > top) top = v, best = i;
    }
    return best;
}

#if MT_AW == 16
static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, p); }
static inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), x);  // lanes past the row: never larger
}

template <typename T>
int64_t first_max(const T* x, int64_t n) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = load16(x + i, m);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 larger = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
        top = _mm512_mask_blend_ps(larger, top, v);
        at = _mm512_mask_blend_epi32(larger, at, idx);
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
    }
    if (nan) return first_max_plain(x, n);  // its first NaN
    const float best = _mm512_reduce_max_ps(top);
    const __mmask16 holders = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(holders, at);
}
#elif MT_AW == 8
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// The same rule in 8 lanes over the whole vectors, the row's last values one by one after them.
template <typename T>
int64_t first_max(const T* x, int64_t n) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    __m256i at = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int nan = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = load8(x + i);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 larger = _mm256_cmp_ps(v, top, _CMP_GT_OQ);
        top = _mm256_blendv_ps(top, v, larger);
        at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), larger));
        idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
    }
    if (nan) return first_max_plain(x, n);  // its first NaN
    alignas(32) float tops[8];
    alignas(32) int32_t ats[8];
    _mm256_store_ps(tops, top);
    _mm256_store_si256((__m256i*)ats, at);
    float best = -INFINITY;
    int64_t where = 0;  // a row of -inf only: its first
    for (int j = 0; j < 8; ++j)
        if (tops[j] > best || (tops[j] == best && tops[j] > -INFINITY && ats[j] < where)) best = tops[j], where = ats[j];
    for (; i < n; ++i) {
        const float v = static_cast<float>(x[i]);
        if (std::isnan(v)) return i;
        if (v > best) best = v, where = i;
    }
    return where;
}
#else
template <typename T>
int64_t first_max(const T* x, int64_t n) { return first_max_plain(x, n); }
#endif

// x [..., V] (V < 2^31, contiguous) # -> [...] long: each row's first maximum (rows over the threads).
at::Tensor rows_max_index(const at::Tensor& x) {
    TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) < (int64_t(1) << 31) && x.is_contiguous() &&
                (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "rows_max_index: x must be a contiguous float32 or bfloat16 CPU tensor [..., V], 0 < V < 2^31");
    const int64_t V = x.size(-1), R = x.numel() / V;
    at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
    int64_t* o = out.data_ptr<int64_t>();
    const bool bf = x.scalar_type() == at::kBFloat16;
    const void* base = x.data_ptr();
    const int threads = (int)std::min<int64_t>(omp_get_max_threads(), R);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < R; ++r)
        o[r] = bf ? first_max(static_cast<const c10::BFloat16*>(base) + r * V, V) : first_max(static_cast<const float*>(base) + r * V, V);
    return out;
}

// A (value, index) pair as one key, larger for the better pair: the value's order in the high
// half (NaN above +inf, -0 as +0), the index's reverse in the low half (a lower index is better).
static inline uint64_t rank_key(float v, int64_t i) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    if (std::isnan(v)) u = 0xFFFFFFFFu;
    else if (v == 0.0f) u = 0x80000000u;  // -0 and +0 are equal
    else u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return (uint64_t)u << 32 | (uint32_t)~(uint32_t)i;
}

// The largest value of x[lo, hi), NaNs left out (-inf where there is none).
template <typename T>
float block_max(const T* x, int64_t lo, int64_t hi) {
    float top = -INFINITY;
    int64_t i = lo;
#if MT_AW == 16
    __m512 v16 = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= hi; i += 16) v16 = _mm512_max_ps(load16(x + i, (__mmask16)0xFFFF), v16);  // a NaN lane keeps v16's
    top = _mm512_reduce_max_ps(v16);
#elif MT_AW == 8
    __m256 v8 = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= hi; i += 8) v8 = _mm256_max_ps(load8(x + i), v8);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v8);
    for (float l : lanes) top = std::max(top, l);
#endif
    for (; i < hi; ++i) {
        const float v = static_cast<float>(x[i]);
        if (v > top) top = v;
    }
    return top;
}

// keys of every (value, index) of x [n] with value >= floor or NaN, in index order.
template <typename T>
void candidates(const T* x, int64_t n, float floor, std::vector<uint64_t>& keys) {
    keys.clear();
    int64_t i = 0;
#if MT_AW == 16
    const __m512 f16 = _mm512_set1_ps(floor);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = load16(x + i, (__mmask16)0xFFFF);
        for (__mmask16 at = _mm512_cmp_ps_mask(v, f16, _CMP_NLT_UQ); at; at &= at - 1)  // not below: >= or NaN
            keys.push_back(rank_key(static_cast<float>(x[i + __builtin_ctz(at)]), i + __builtin_ctz(at)));
    }
#elif MT_AW == 8
    const __m256 f8 = _mm256_set1_ps(floor);
    for (; i + 8 <= n; i += 8)
        for (unsigned at = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(load8(x + i), f8, _CMP_NLT_UQ)); at; at &= at - 1)
            keys.push_back(rank_key(static_cast<float>(x[i + __builtin_ctz(at)]), i + __builtin_ctz(at)));
#endif
    for (; i < n; ++i) {
        const float v = static_cast<float>(x[i]);
        if (!(v < floor)) keys.push_back(rank_key(v, i));
    }
}

// The k best (value, index) pairs of row x [n] (k <= n < 2^32), best first, into vals / ids.
// Only the values at or above a floor (and NaNs) are ranked: the k-th largest of min(2k, n) block
// maxima, NaNs left out (k distinct values are at or above it, so the row's k-th best is too).
template <typename T>
void row_topk(const T* x, int64_t n, int64_t k, T* vals, int64_t* ids, std::vector<float>& maxima,
              std::vector<uint64_t>& keys) {
    const int64_t blocks = std::min(2 * k, n), width = n / blocks;
    maxima.resize(blocks);
    for (int64_t b = 0; b < blocks; ++b) maxima[b] = block_max(x, b * width, (b + 1) * width);
    std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<float>());
    candidates(x, n, maxima[k - 1], keys);  // >= k keys
    std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint64_t>());
    std::sort(keys.begin(), keys.begin() + k, std::greater<uint64_t>());  // best first
    for (int64_t j = 0; j < k; ++j) {
        const int64_t at = (uint32_t)~(uint32_t)keys[j];
        vals[j] = x[at], ids[j] = at;
    }
}

// x [..., V] (contiguous float32 or bfloat16), 0 < k <= V # -> (values [..., k] of x's dtype,
// indices [..., k] long): each row's k best by ``rank_key`` (rows over the threads).
std::tuple<at::Tensor, at::Tensor> rows_topk(const at::Tensor& x, int64_t k) {
    TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) < (int64_t(1) << 32) && x.is_contiguous() &&
                (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "rows_topk: x must be a contiguous float32 or bfloat16 CPU tensor [..., V], 0 < V < 2^32");
    const int64_t V = x.size(-1), R = x.numel() / V;
    TORCH_CHECK(k > 0 && k <= V, "rows_topk: k must be in 1..", V, ", got ", k);
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = k;
    at::Tensor vals = at::empty(sizes, x.options()), ids = at::empty(sizes, x.options().dtype(at::kLong));
    const bool bf = x.scalar_type() == at::kBFloat16;
    const void* base = x.data_ptr();
    void* vout = vals.data_ptr();
    int64_t* iout = ids.data_ptr<int64_t>();
    const int threads = (int)std::min<int64_t>(omp_get_max_threads(), std::max<int64_t>(R, 1));
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<float> maxima;
        std::vector<uint64_t> keys;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r) {
            if (bf) row_topk(static_cast<const c10::BFloat16*>(base) + r * V, V, k, static_cast<c10::BFloat16*>(vout) + r * k, iout + r * k, maxima, keys);
            else row_topk(static_cast<const float*>(base) + r * V, V, k, static_cast<float*>(vout) + r * k, iout + r * k, maxima, keys);
        }
    }
    return {vals, ids};
}

}  // namespace
