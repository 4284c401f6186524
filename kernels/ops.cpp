// The CPU kernels as torch ops (gemv_rows.py builds this file with torch.utils.cpp_extension): the
// schemas, and the checks every call passes before a raw pointer is read (dtype, device, layout,
// shapes, format). One translation unit: the kernels are included below, not linked.
//
// Formats: the values come from kernels/formats.py's ``Format`` enum, passed as -DMT_FORMAT_<NAME>
// by the build (one source of truth; so are MT_MAX_ROWS and the namespace); an unknown value is an
// error here as it is in Python.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "gemv_rows.cpp"
#include "argmax_prefilter.cpp"
#include "gemv_int8.cpp"

#if !defined(MT_NAMESPACE) || !defined(MT_MAX_ROWS) || !defined(MT_FORMAT_F32) || !defined(MT_FORMAT_Q4_1) || !defined(MT_FORMAT_Q8_0) || \
    !defined(MT_FORMAT_BF16) || !defined(MT_FORMAT_F16) || !defined(MT_FORMAT_Q4_1_Q8) || !defined(MT_FORMAT_Q8_0_Q8)
#error "built without the formats and namespace of kernels/formats.py: build through gemv_rows.py"
#endif

namespace {

constexpr int64_t MAX_ROWS = MT_MAX_ROWS;  // rows per kernel call (gemv_rows.MAX_ROWS); longer inputs are cut into such calls

// Rows x [..., K]: float32, CPU, contiguous, at least one dimension.
void check_rows(const at::Tensor& x, const char* op) {
    TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU, not ", x.device());
    TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, not ", x.scalar_type());
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must be [..., K] with K > 0, got ", x.sizes());
    TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
}

// A packed weight: CPU, contiguous, [ceil(N / L), inner, width] of ``dtype``.
void check_packed(const at::Tensor& w, at::ScalarType dtype, int64_t n, int64_t inner, int64_t width, const char* op) {
    TORCH_CHECK(w.device().is_cpu() && w.is_contiguous(), op, ": the packed weight must be a contiguous CPU tensor");
    TORCH_CHECK(w.scalar_type() == dtype, op, ": the packed weight must be ", dtype, ", not ", w.scalar_type());
    TORCH_CHECK(n > 0, op, ": n must be > 0, got ", n);
    const int64_t blocks = (n + L - 1) / L;
    TORCH_CHECK(w.dim() == 3 && w.size(0) == blocks && w.size(1) == inner && w.size(2) == width, op,
                ": the packed weight must be [", blocks, ", ", inner, ", ", width, "] for n=", n, ", got ", w.sizes());
}

void check_vector(const at::Tensor& t, int64_t at_least, const char* what, const char* op) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat && t.dim() == 1 &&
                t.size(0) >= at_least, op, ": ", what, " must be a contiguous float32 CPU vector of >= ", at_least,
                " entries, got ", t.scalar_type(), " ", t.sizes());
}

int64_t lanes() { return L; }

bool prefilter() { return prefilter_built(); }

// x [..., K] times the weight ``w`` stored in ``format`` -> [..., n] float32 (+ bias).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, int64_t format, int64_t n, const std::optional<at::Tensor>& bias) {
    const char* op = "gemv";
    check_rows(x, op);
    const int64_t K = x.size(-1), M = x.numel() / K;
    TORCH_CHECK(K <= INT32_MAX && n <= INT32_MAX && M * std::max<int64_t>(K, n) < INT64_MAX / 4, op, ": too large");
    const bool q4 = format == MT_FORMAT_Q4_1 || format == MT_FORMAT_Q4_1_Q8;  // one layout, two kernels
    const bool q8 = format == MT_FORMAT_Q8_0 || format == MT_FORMAT_Q8_0_Q8;
    const bool codes = q4 || q8;
    TORCH_CHECK(!codes || K % QK == 0, op, ": Q4_1 / Q8_0 weights need K a multiple of ", QK, ", got ", K);
    if (format == MT_FORMAT_F32) check_packed(w, at::kFloat, n, K, L, op);
    else if (format == MT_FORMAT_BF16 || format == MT_FORMAT_F16) check_packed(w, at::kByte, n, K, 2 * L, op);
    else if (q4) check_packed(w, at::kByte, n, K / QK, chunk_bytes<Q4>(), op);
    else if (q8) check_packed(w, at::kByte, n, K / QK, chunk_bytes<Q8>(), op);
    else TORCH_CHECK(false, op, ": unknown weight format ", format, " (kernels/formats.py lists the formats)");
    if (bias.has_value()) check_vector(*bias, n, "bias", op);
    TORCH_CHECK(!bias.has_value() || bias->size(0) == n, op, ": bias must have n=", n, " entries");
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor out = at::empty(sizes, x.options());
    const float* xp = x.data_ptr<float>();
    float* op_out = out.data_ptr<float>();
    for (int64_t start = 0; start < M; start += MAX_ROWS) {
        const int rows = (int)std::min(MAX_ROWS, M - start);
        const float* xs = xp + start * K;
        float* os = op_out + start * n;
        if (format == MT_FORMAT_F32) rows_linear(xs, w.data_ptr<float>(), os, rows, (int)K, (int)n);
        else if (format == MT_FORMAT_Q4_1) narrow_linear<Q4>(xs, w.data_ptr<uint8_t>(), os, rows, (int)K, (int)n);
        else if (format == MT_FORMAT_Q4_1_Q8) q8_rows_linear<Q4>(xs, w.data_ptr<uint8_t>(), os, rows, (int)K, (int)n);
        else if (format == MT_FORMAT_Q8_0_Q8) q8_rows_linear<Q8>(xs, w.data_ptr<uint8_t>(), os, rows, (int)K, (int)n);
        else if (format == MT_FORMAT_Q8_0) narrow_linear<Q8>(xs, w.data_ptr<uint8_t>(), os, rows, (int)K, (int)n);
        else if (format == MT_FORMAT_BF16) narrow_linear<BF16>(xs, w.data_ptr<uint8_t>(), os, rows, (int)K, (int)n);
        else narrow_linear<F16>(xs, w.data_ptr<uint8_t>(), os, rows, (int)K, (int)n);
    }
    if (bias.has_value()) out.add_(*bias);
    return out;
}

// The int8 screen's logits alone: x [M, K] times q [ceil(n / L), K, L], each output times scale.
at::Tensor screened(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t n) {
    const char* op = "screened";
    check_rows(x, op);
    const int64_t K = x.size(-1), M = x.numel() / K;
    check_packed(q, at::kChar, n, K, L, op);
    check_vector(scale, n, "scale", op);
    at::Tensor out = at::empty({M, n}, x.options());
    rows_screened(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), out.data_ptr<float>(), (int)M, (int)K, (int)n);
    return out;
}

// The float32 blocks' argmax per row of x [M, K] (M <= MAX_ROWS) through the int8 screen:
// (best [M] long, outputs computed exactly); that count is -1 where x or a logit is not finite.
std::tuple<at::Tensor, int64_t> rows_argmax_op(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                               const at::Tensor& err, const at::Tensor& w, int64_t n) {
    const char* op = "rows_argmax";
    check_rows(x, op);
    const int64_t K = x.size(-1), M = x.numel() / K;
    TORCH_CHECK(M >= 1 && M <= MAX_ROWS, op, ": takes 1 to ", MAX_ROWS, " rows, got ", M);
    check_packed(q, at::kChar, n, K, L, op);
    check_packed(w, at::kFloat, n, K, L, op);
    check_vector(scale, n, "scale", op);
    check_vector(err, n, "err", op);
    at::Tensor approx = at::empty({M, n}, x.options());
    at::Tensor best = at::empty({M}, x.options().dtype(at::kLong));
    const int64_t picked = rows_argmax(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), err.data_ptr<float>(),
                                       w.data_ptr<float>(), approx.data_ptr<float>(), best.data_ptr<int64_t>(), (int)M, (int)K, (int)n);
    return {best, picked};
}

// Q8_0 codes' argmax per row of x [M, K] (M <= MAX_ROWS) through the int16 prefilter: (best [M]
// long, outputs recounted); -1 where x or a recount is not finite, -2 where this build has no prefilter.
std::tuple<at::Tensor, int64_t> q8_argmax_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& l1, int64_t n) {
    const char* op = "q8_argmax";
    check_rows(x, op);
    const int64_t K = x.size(-1), M = x.numel() / K;
    TORCH_CHECK(M >= 1 && M <= MAX_ROWS, op, ": takes 1 to ", MAX_ROWS, " rows, got ", M);
    TORCH_CHECK(K % QK == 0, op, ": Q8_0 weights need K a multiple of ", QK, ", got ", K);
    check_packed(w, at::kByte, n, K / QK, chunk_bytes<Q8>(), op);
    check_vector(l1, n, "l1", op);
    at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kShort));
    at::Tensor amax = at::empty({M}, x.options());
    at::Tensor approx = at::empty({M, n}, x.options());
    at::Tensor best = at::empty({M}, x.options().dtype(at::kLong));
    const int64_t picked = q8_argmax(x.data_ptr<float>(), w.data_ptr<uint8_t>(), l1.data_ptr<float>(), xq.data_ptr<int16_t>(),
                                     amax.data_ptr<float>(), approx.data_ptr<float>(), best.data_ptr<int64_t>(), (int)M, (int)K, (int)n);
    return {best, picked};
}

}  // namespace

#include "row_attention.cpp"
#include "decode_attention.cpp"
#include "rows_max.cpp"
#include "layer_step.cpp"

// The namespace is the build's (MT_NAMESPACE, one per CPU-feature level): two levels' builds can
// be loaded in one process side by side.
#define MT_DEFINE(ns, m) TORCH_LIBRARY(ns, m)
#define MT_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

MT_DEFINE(MT_NAMESPACE, m) {
    m.def("lanes() -> int", &lanes);
    m.def("prefilter_built() -> bool", &prefilter);
    m.def("gemv(Tensor x, Tensor w, int format, int n, Tensor? bias) -> Tensor");
    m.def("screened(Tensor x, Tensor q, Tensor scale, int n) -> Tensor");
    m.def("rows_argmax(Tensor x, Tensor q, Tensor scale, Tensor err, Tensor w, int n) -> (Tensor, int)");
    m.def("q8_argmax(Tensor x, Tensor w, Tensor l1, int n) -> (Tensor, int)");
    m.def("row_attention(Tensor q, Tensor k_buf, Tensor v_buf, int past, Tensor? mask, float scale) -> Tensor");
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
    m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
    m.def("rotary_step(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
    m.def("rows_max_index(Tensor x) -> Tensor");
    m.def("rows_topk(Tensor x, int k) -> (Tensor, Tensor)");
    m.def("llama_row(Tensor hidden, Tensor[] weights, Tensor?[] biases, int[] sizes, float[] scalars, Tensor cos, "
          "Tensor signed_sin, Tensor(a!) k_buf, Tensor(b!) v_buf, int past, Tensor? mask, bool gqa) -> Tensor");
    m.def("llama_rows(Tensor hidden, Tensor[] weights, Tensor?[] biases, int[] sizes, float[] scalars, Tensor cos, "
          "Tensor signed_sin, Tensor(a!)[] k_bufs, Tensor(b!)[] v_bufs, int past, Tensor? mask, bool gqa, "
          "int[] keep, Tensor? norm, float norm_eps) -> Tensor[]");
}

MT_IMPL(MT_NAMESPACE, m) {
    m.impl("gemv", &gemv);
    m.impl("screened", &screened);
    m.impl("rows_argmax", &rows_argmax_op);
    m.impl("q8_argmax", &q8_argmax_op);
    m.impl("row_attention", &row_attention);
    m.impl("decode_attention", &decode_attention);
    m.impl("rms_norm", &rms_norm_op);
    m.impl("rotary_step", &rotary_step);
    m.impl("rows_max_index", &rows_max_index);
    m.impl("rows_topk", &rows_topk);
    m.impl("llama_row", &llama_row);
    m.impl("llama_rows", &llama_rows);
}
