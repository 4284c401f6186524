// Attention of a batch's one-token decoding step on bfloat16 KV caches, as one op (ops.cpp includes
// this after row_attention.cpp, whose ``sums16``, ``exp_sum`` and ``MT_AW`` it uses).
//
// Why: SDPA's CPU kernel runs such a step as B x q heads separate products of one query row, each
// with its own setup; at a distillation batch (hundreds of rows) that costs several times what it
// takes to read the keys and values once. Here the query heads of one kv head (GQA) share every key
// and value read, one (row, kv head) at a time.
//
// Per row and query head, its kv head h / (q heads / kv heads):
//   s_i = (q . k_i) * scale over the slots the mask leaves (all where there is none): float32 sums
//   of the bfloat16 inputs' products, which are exact in float32 (AVX512-BF16: VDPBF16PS, two
//   features a lane; other builds: one fused multiply-add per feature), then the lanes' fixed sum;
//   m = max s; p_i = exp(s_i - m) and l = sum p_i (row_attention.cpp's exp_sum);
//   out = (sum_i p_i v_i, slots in order, one fused multiply-add each) / l, rounded once to
//   bfloat16 (nearest even). A row that sees no slot gives NaN (a softmax over nothing).
// A (row, kv head) is computed whole by one thread: the bits do not depend on the thread count nor
// on the other rows. The sums' order is this build's, not SDPA's: the values agree within rounding.
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

#if MT_AW == 16
// 16 bfloat16 -> 16 float32, exactly (a bfloat16 is a float32's high half)
static inline __m512 widen16(const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#endif

// s[i] = (q . k_i) * scale for slots k_i = k + i * ks, i < n (q: the query as float32 and as bf16).
static void bf16_scores(const float* q, const bf16* qb, const bf16* k, int64_t ks, int n, int d, float scale, float* s) {
#if MT_AW == 16
    if (d % 32 == 0 && d <= 256) {
#if defined(__AVX512BF16__)
        __m512bh qv[8];
        for (int e = 0; e < d / 32; ++e) qv[e] = (__m512bh)_mm512_loadu_si512(qb + 32 * e);
#else
        __m512 qv[16];
        for (int e = 0; e < d / 16; ++e) qv[e] = _mm512_loadu_ps(q + 16 * e);
#endif
        for (int i = 0; i < n; i += 16) {
            __m512 acc[16];
            for (int t = 0; t < 16; ++t) {
                const bf16* kr = k + (int64_t)std::min(i + t, n - 1) * ks;  // past n: the last slot again, dropped below
#if defined(__AVX512BF16__)
                acc[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(kr), qv[0]);
                for (int e = 1; e < d / 32; ++e) acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_loadu_si512(kr + 32 * e), qv[e]);
#else
                acc[t] = _mm512_mul_ps(qv[0], widen16(kr));
                for (int e = 1; e < d / 16; ++e) acc[t] = _mm512_fmadd_ps(qv[e], widen16(kr + 16 * e), acc[t]);
#endif
            }
            alignas(64) float out[16];
            _mm512_store_ps(out, _mm512_mul_ps(sums16(acc), _mm512_set1_ps(scale)));
            std::memcpy(s + i, out, sizeof(float) * std::min(16, n - i));
        }
        return;
    }
#endif
    (void)qb;
    for (int i = 0; i < n; ++i) {
        const bf16* kr = k + (int64_t)i * ks;
        float lanes[MT_AW] = {};
        for (int e = 0; e < d; e += MT_AW)
            for (int j = 0; j < MT_AW && e + j < d; ++j) lanes[j] = madd(q[e + j], static_cast<float>(kr[e + j]), lanes[j]);
        for (int w = MT_AW / 2; w >= 1; w /= 2)
            for (int j = 0; j < w; ++j) lanes[j] = lanes[j] + lanes[j + w];
        s[i] = lanes[0] * scale;
    }
}

// out [d] = (sum over the visible slots of p_i v_i) / l, v_i = v + i * vs, rounded to bfloat16.
static void bf16_values(const float* p, const bool* mask, int64_t ms, const bf16* v, int64_t vs, int n, int d, float l,
                        float* scratch, bf16* out) {
#if MT_AW == 16
    if (d % 16 == 0 && d <= 256) {
        __m512 acc[16];
        for (int e = 0; e < d / 16; ++e) acc[e] = _mm512_setzero_ps();
        for (int i = 0; i < n; ++i) {
            if (mask != nullptr && !mask[i * ms]) continue;  // a masked slot's values may be anything
            const __m512 pi = _mm512_set1_ps(p[i]);
            for (int e = 0; e < d / 16; ++e) acc[e] = _mm512_fmadd_ps(pi, widen16(v + i * vs + 16 * e), acc[e]);
        }
        for (int e = 0; e < d / 16; ++e) {
            const __m512 x = _mm512_div_ps(acc[e], _mm512_set1_ps(l));
#if defined(__AVX512BF16__)
            _mm256_storeu_si256((__m256i*)(out + 16 * e), (__m256i)_mm512_cvtneps_pbh(x));  // nearest even, as c10's
#else
            _mm512_storeu_ps(scratch + 16 * e, x);
#endif
        }
#if !defined(__AVX512BF16__)
        for (int e = 0; e < d; ++e) out[e] = bf16(scratch[e]);  // c10's rounding: nearest even
#endif
        return;
    }
#endif
    std::fill(scratch, scratch + d, 0.0f);
    for (int i = 0; i < n; ++i) {
        if (mask != nullptr && !mask[i * ms]) continue;
        const bf16* vr = v + (int64_t)i * vs;
        for (int e = 0; e < d; ++e) scratch[e] = madd(p[i], static_cast<float>(vr[e]), scratch[e]);
    }
    for (int e = 0; e < d; ++e) out[e] = bf16(scratch[e] / l);
}

// One query head: q [d] on n slots of its kv head # -> out [d]; s, scratch: the thread's buffers.
static void bf16_head(const bf16* qb, const bf16* k, int64_t ks, const bf16* v, int64_t vs, const bool* mask, int64_t ms,
                      int n, int d, float scale, std::vector<float>& s, std::vector<float>& scratch, bf16* out) {
    const int padded = (n + MT_AW - 1) / MT_AW * MT_AW;
    float* q = scratch.data() + 256;  // scratch: [256] for the values' sums, then the query as float32
    for (int e = 0; e < d; ++e) q[e] = static_cast<float>(qb[e]);
    s.assign(padded, -std::numeric_limits<float>::infinity());  // the pad: exp gives 0
    bf16_scores(q, qb, k, ks, n, d, scale, s.data());
    float m = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < n; ++i) {
        if (mask != nullptr && !mask[i * ms]) s[i] = -std::numeric_limits<float>::infinity();
        m = std::max(m, s[i]);
    }
    if (m == -std::numeric_limits<float>::infinity()) {
        std::fill(out, out + d, bf16(std::numeric_limits<float>::quiet_NaN()));
        return;
    }
    bf16_values(s.data(), mask, ms, v, vs, n, d, exp_sum(s.data(), padded, m), scratch.data(), out);
}

// Asks the caches for row b's kv head h: its L slots of keys and of values [L, d] (cache lines).
static void prefetch_slots(const bf16* kp, const bf16* vp, const at::Tensor& k, const at::Tensor& v, int64_t b, int64_t h,
                           int64_t L, int64_t d) {
    const bf16* kh = kp + b * k.stride(0) + h * k.stride(1);
    const bf16* vh = vp + b * v.stride(0) + h * v.stride(1);
    for (int64_t i = 0; i < L; ++i)
        for (int64_t e = 0; e < d; e += 32) {  // 64 bytes a line
            __builtin_prefetch(kh + i * k.stride(2) + e);
            __builtin_prefetch(vh + i * v.stride(2) + e);
        }
}

// q [B, q heads, 1, d], k / v [B, kv heads, L, d] (features contiguous; any other strides), mask
// [B or 1, 1, 1, L] bool or none # -> out [B, 1, q heads, d] bf16 (transformers' attention layout).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, double scale) {
    const char* op = "decode_attention";
    TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 && q.dim() == 4 && q.size(2) == 1 &&
                q.stride(3) == 1 && q.size(3) > 0 && q.size(3) <= 256, op,
                ": q must be a bfloat16 CPU tensor [B, q heads, 1, d <= 256], its features contiguous");
    const int64_t B = q.size(0), Hq = q.size(1), d = q.size(3);
    TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == d && k.size(2) > 0 &&
                k.size(1) > 0 && Hq % k.size(1) == 0 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
                k.device().is_cpu() && v.device().is_cpu() && k.stride(3) == 1 && v.stride(3) == 1,
                op, ": keys and values must be bfloat16 CPU tensors [", B, ", kv heads dividing ", Hq, ", L > 0, ", d,
                "], their features contiguous");
    const int64_t Hk = k.size(1), L = k.size(2), G = Hq / Hk;
    const bool* mp = nullptr;
    int64_t mb = 0, ms = 0;
    if (mask.has_value()) {
        const at::Tensor& m = *mask;
        TORCH_CHECK(m.scalar_type() == at::kBool && m.device().is_cpu() && m.dim() == 4 && (m.size(0) == B || m.size(0) == 1) &&
                    m.size(1) == 1 && m.size(2) == 1 && m.size(3) == L, op, ": the mask must be bool [", B, " or 1, 1, 1, ", L, "]");
        mp = m.data_ptr<bool>();
        mb = m.size(0) == 1 ? 0 : m.stride(0);
        ms = m.stride(3);
    }
    at::Tensor out = at::empty({B, 1, Hq, d}, q.options());
    const bf16* qp = q.data_ptr<at::BFloat16>();
    const bf16* kp = k.data_ptr<at::BFloat16>();
    const bf16* vp = v.data_ptr<at::BFloat16>();
    bf16* op_ = out.data_ptr<at::BFloat16>();
    const int64_t count = B * Hk;
    const int threads = (int)std::min<int64_t>(omp_get_max_threads(), count);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        std::vector<float> s, scratch(512);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; ++i) {
            const int64_t b = i / Hk, h = i % Hk;
            if (i + 1 < count)  // the next kv head's slots, fetched while this one computes: they lie
                prefetch_slots(kp, vp, k, v, (i + 1) / Hk, (i + 1) % Hk, L, d);  // pages apart, past the hardware's streams
            for (int64_t j = 0; j < G; ++j) {
                const int64_t head = h * G + j;
                bf16_head(qp + b * q.stride(0) + head * q.stride(1), kp + b * k.stride(0) + h * k.stride(1), k.stride(2),
                          vp + b * v.stride(0) + h * v.stride(1), v.stride(2), mp == nullptr ? nullptr : mp + b * mb, ms,
                          (int)L, (int)d, (float)scale, s, scratch, op_ + (b * Hq + head) * d);
            }
        }
    }
    return out;
}

}  // namespace
