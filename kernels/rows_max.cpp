// The first maximum of each row of float32 or bfloat16 logits, as ``x.max(-1).indices`` picks it
// (ops.cpp includes this after row_attention.cpp, whose ``MT_AW`` it uses).
//
// Why: greedy decoding reads only each row's argmax, and torch's max with indices walks bfloat16
// logits one value at a time; a distillation step's [256, 49152] logits take it several times
// the time reading them once takes. Here each row is read once in vectors: per lane the largest
// value and its first index (a later equal value does not replace it), then the lanes' largest
// and, among the lanes that hold it, the smallest index. torch's rule, exactly: a row with a NaN
// gives its first NaN; otherwise the first index of the largest value (-0 and +0 are equal).
#include <c10/util/BFloat16.h>

#include <cmath>

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

}  // namespace
