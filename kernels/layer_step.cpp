// A Llama decoder layer's step of one sequence's rows as one op (ops.cpp includes this after
// ``gemv``): the ops of pipeline/model/lean_layers.py's one-row and multi-row paths, in their
// order, called from C++.
//
// Why: a one-token decoding step of a small model is mostly the Python between ~40 small ops per
// layer (docs/benchmarks/profile.md). Here those with an order of their own are the same ATen ops
// on the same tensors (the dispatcher picks the same kernels), the element-wise ones loops of the
// same roundings (below), and the linears the same ``gemv`` calls, so every output is the Python
// path's, bit for bit (tests/pipeline/test_lean_layers.py); only the interpreter is gone.
// lean_rows.py decides where this applies (one sequence of up to MAX_ROWS rows, float32, SDPA
// attention, RMSNorm, SiLU, every linear packed in a compiled format, a KV cache buffer with room
// for the rows) and keeps the cache's length.
#include <ATen/record_function.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>

#include <cmath>
#include <cstring>

namespace {

// Element-wise steps as loops, each element's arithmetic that of torch's ops: products, sums,
// a square root and a quotient, each rounded once (IEEE); the build passes -ffp-contract=off, so
// no product and sum are fused into one rounding where torch's separate ops round twice.

// LlamaRMSNorm on float32 rows x [1, T, H] (its casts are no-ops there): w * (x * rsqrt(mean(x^2)
// + eps)). The mean's sum stays torch's (its order is its kernel's); at::mean is that sum divided
// in place by the count (a float division), done here; the rest, one element at a time.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
    const int64_t H = x.size(-1), T = x.numel() / H;
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == H, "llama_row: a norm's weight must be float32 [H]");
    const float* xp = x.data_ptr<float>();
    at::Tensor squares = at::empty_like(x);  // torch's pow(x, 2) is x * x
    float* sp = squares.data_ptr<float>();
    for (int64_t i = 0; i < T * H; ++i) sp[i] = xp[i] * xp[i];
    const at::Tensor sums = squares.sum({-1}, true);  // [1, T, 1]
    const float* sum = sums.data_ptr<float>();
    at::Tensor out = at::empty_like(x);
    const float* wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
        const float variance = sum[t] / static_cast<float>(H);
        const float r = 1.0f / std::sqrt(variance + static_cast<float>(eps));  // torch: add (eps as float), rsqrt
        for (int64_t i = 0; i < H; ++i) op[t * H + i] = wp[i] * (xp[t * H + i] * r);
    }
    return out;
}

// LlamaRMSNorm on bfloat16 rows x [..., H] with its bfloat16 weight, each step rounded as the
// module's: h = float(x); the mean of h * h as above (torch's sum, then a float division);
// r = 1 / sqrt(variance + eps); out = bf16(float(w) * float(bf16(h * r))) (the cast back to the
// input's dtype, then the weight's product in bfloat16: exact in float32, rounded once).
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
    const int64_t H = x.size(-1), T = x.numel() / H;
    const c10::BFloat16* xp = x.data_ptr<at::BFloat16>();
    at::Tensor squares = at::empty(x.sizes(), x.options().dtype(at::kFloat));
    float* sp = squares.data_ptr<float>();
    for (int64_t i = 0; i < T * H; ++i) {
        const float h = static_cast<float>(xp[i]);
        sp[i] = h * h;
    }
    const at::Tensor sums = squares.sum({-1}, true);
    const float* sum = sums.data_ptr<float>();
    at::Tensor out = at::empty_like(x);
    const c10::BFloat16* wp = w.data_ptr<at::BFloat16>();
    c10::BFloat16* op = out.data_ptr<at::BFloat16>();
    for (int64_t t = 0; t < T; ++t) {
        const float variance = sum[t] / static_cast<float>(H);
        const float r = 1.0f / std::sqrt(variance + static_cast<float>(eps));
        for (int64_t i = 0; i < H; ++i) {
            const c10::BFloat16 normed(static_cast<float>(xp[t * H + i]) * r);
            op[t * H + i] = c10::BFloat16(static_cast<float>(wp[i]) * static_cast<float>(normed));
        }
    }
    return out;
}

// a += b element-wise over contiguous float32 tensors of one size (a residual add into the
// linear's own fresh output: b + a rounds as a + b).
void add_into(at::Tensor& a, const at::Tensor& b) {
    float* ap = a.data_ptr<float>();
    const float* bp = b.data_ptr<float>();
    for (int64_t i = 0, n = a.numel(); i < n; ++i) ap[i] = bp[i] + ap[i];
}

// Element-wise arithmetic in a tensor's dtype as torch's ops round it: float32 directly; bfloat16
// in float32, then rounded to bfloat16 (nearest even), once per op.
inline float mul_in(float a, float b) { return a * b; }
inline float add_in(float a, float b) { return a + b; }
inline c10::BFloat16 mul_in(c10::BFloat16 a, c10::BFloat16 b) { return c10::BFloat16(static_cast<float>(a) * static_cast<float>(b)); }
inline c10::BFloat16 add_in(c10::BFloat16 a, c10::BFloat16 b) { return c10::BFloat16(static_cast<float>(a) + static_cast<float>(b)); }

// One head x [d] rotated into out [d]: (x * cos) + (rotate_half(x) * sin), rotate_half(x) =
// cat(-x2, x1) of x's halves, each product and the sum rounded as torch's ops round them. NEG:
// ``s`` is sin and the rolled first half is negated; else ``s`` is the signed sin cat(-sin1, sin2)
// (a product's sign is its factors': the same values). roll(x, half)[i] is x[i + half] below
// ``half`` and x[i - half] from it: two loops without a division per element, which the compiler
// vectorises.
template <typename T, bool NEG>
inline void rotate_head(const T* x, const T* c, const T* s, T* out, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; ++i) out[i] = add_in(mul_in(x[i], c[i]), mul_in(NEG ? -x[i + half] : x[i + half], s[i]));
    for (int64_t i = half; i < d; ++i) out[i] = add_in(mul_in(x[i], c[i]), mul_in(x[i - half], s[i]));
}

// The rotary of T rows' q and k heads and the cache's writes: for heads [T, q + 2 kv, d] (the
// fused q|k|v output), q and k rotated (``rotate_head`` on the signed sin: torch's mul, roll, mul
// and add per element), row t's with its tables cos / signed_sin [T, d]: q to
// ``q_out`` [T, q, d], k to slot past + t of ``k_buf`` and v copied to that slot of ``v_buf``
// ([kv, capacity, d] each, contiguous).
void rotate_and_cache(const float* heads, const float* cos, const float* signed_sin, int64_t T, int64_t q_heads,
                      int64_t kv_heads, int64_t d, float* q_out, float* k_buf, float* v_buf,
                      int64_t capacity, int64_t past) {
    const int64_t width = (q_heads + 2 * kv_heads) * d;
    for (int64_t t = 0; t < T; ++t) {
        const float* row = heads + t * width;
        const float* c = cos + t * d;
        const float* s = signed_sin + t * d;
        for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
            const float* x = row + h * d;
            float* out = h < q_heads ? q_out + (t * q_heads + h) * d : k_buf + ((h - q_heads) * capacity + past + t) * d;
            rotate_head<float, false>(x, c, s, out, d);
        }
        for (int64_t h = 0; h < kv_heads; ++h)
            std::memcpy(v_buf + (h * capacity + past + t) * d, row + (q_heads + kv_heads + h) * d, d * sizeof(float));
    }
}

// transformers' apply_rotary_pos_emb on a one-token step's heads x [B, heads, 1, d] (features
// contiguous, any other strides), row b's with its tables cos / sin (row 0's where they have one
// row), each head by ``rotate_head`` # -> out [B, heads, 1, d], contiguous.
template <typename T>
void rotate_step(const T* x, int64_t xb, int64_t xh, int64_t B, int64_t H, int64_t d, const T* cos, const T* sin,
                 int64_t tb, T* out) {
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) rotate_head<T, true>(x + b * xb + h * xh, cos + b * tb, sin + b * tb, out + (b * H + h) * d, d);
}

at::Tensor rotated(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const int64_t B = x.size(0), H = x.size(1), d = x.size(3);
    at::Tensor out = at::empty({B, H, 1, d}, x.options());
    const int64_t tb = cos.size(0) == 1 ? 0 : cos.stride(0);
    if (x.scalar_type() == at::kFloat)
        rotate_step(x.data_ptr<float>(), x.stride(0), x.stride(1), B, H, d, cos.data_ptr<float>(), sin.data_ptr<float>(), tb,
                    out.data_ptr<float>());
    else
        rotate_step(x.data_ptr<at::BFloat16>(), x.stride(0), x.stride(1), B, H, d, cos.data_ptr<at::BFloat16>(),
                    sin.data_ptr<at::BFloat16>(), tb, out.data_ptr<at::BFloat16>());
    return out;
}

// q and k [B, heads, 1, d] of a one-token step rotated (rotate_step) by the step's tables cos /
// sin [B or 1, 1, d] (the same strides) # -> (q, k) rotated.
std::tuple<at::Tensor, at::Tensor> rotary_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
    const auto dtype = q.scalar_type();
    const int64_t B = q.dim() == 4 ? q.size(0) : -1, d = q.dim() == 4 ? q.size(3) : -1;
    bool ok = (dtype == at::kFloat || dtype == at::kBFloat16) && d > 0 && d % 2 == 0;
    for (const at::Tensor* x : {&q, &k})
        ok = ok && x->device().is_cpu() && x->scalar_type() == dtype && x->dim() == 4 && x->size(0) == B && x->size(2) == 1 &&
             x->size(3) == d && x->stride(3) == 1;
    for (const at::Tensor* t : {&cos, &sin})
        ok = ok && t->device().is_cpu() && t->scalar_type() == dtype && t->dim() == 3 && (t->size(0) == B || t->size(0) == 1) &&
             t->size(0) == cos.size(0) && t->size(1) == 1 && t->size(2) == d && t->stride(2) == 1 && t->stride(0) == cos.stride(0);
    TORCH_CHECK(ok, "rotary_step: q and k must be [B, heads, 1, d] (d even, features contiguous) and cos / sin [B or 1, 1, d], "
                "all float32 or all bfloat16 CPU tensors");
    return {rotated(q, cos, sin), rotated(k, cos, sin)};
}

// transformers' repeat_kv: [1, kv, S, d] -> [1, kv * n, S, d], each kv head n times.
at::Tensor repeat_kv(const at::Tensor& x, int64_t n) {
    return x.unsqueeze(2).expand({x.size(0), x.size(1), n, x.size(2), x.size(3)}).reshape({x.size(0), x.size(1) * n, x.size(2), x.size(3)});
}

#define MT_NAME(ns) #ns
#define MT_OP_NAME(ns, op) MT_NAME(ns) "::" op

// Linear ``i`` of a layer: weights[i], formats / ns in sizes, its bias (or none). Called directly,
// not through the dispatcher: recorded under the op's name for a profiler (free when none runs).
at::Tensor linear(const at::Tensor& x, at::TensorList weights, const std::optional<at::Tensor>* biases,
                  at::IntArrayRef sizes, int64_t i) {
    RECORD_FUNCTION(MT_OP_NAME(MT_NAMESPACE, "gemv"), std::vector<c10::IValue>());
    return gemv(x, weights[i], sizes[2 * i], sizes[2 * i + 1], biases[i]);
}

constexpr int64_t ROW_WEIGHTS = 6, ROW_SIZES = 19, ROW_SCALARS = 3;  // per layer (see layer_row)
constexpr int64_t SDPA = 0, PER_ROW = 1;  // sizes[0]: the attention (see layer_row)

// The attention of rows q [T, q heads, d] on the cache buffers [1, kv heads, capacity, d] (slots up to
// past + T filled) by row_attention.cpp: every slot before ``past``, and of the rows' own those
// ``mask`` [.., T, past + T] (bool) marks; no mask: T == 1, every slot # -> [1, T, q heads x d].
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, int64_t past,
                         const std::optional<at::Tensor>& mask, double scale) {
    const char* op = "row_attention";
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.device().is_cpu(), op,
                ": q must be a contiguous float32 CPU tensor [T, q heads, d]");
    const int64_t T = q.size(0), q_heads = q.size(1), d = q.size(2);
    TORCH_CHECK(k_buf.dim() == 4 && k_buf.size(0) == 1 && k_buf.size(3) == d && v_buf.sizes() == k_buf.sizes() &&
                k_buf.scalar_type() == at::kFloat && v_buf.scalar_type() == at::kFloat && k_buf.is_contiguous() &&
                v_buf.is_contiguous() && past >= 0 && past + T <= k_buf.size(2) && k_buf.size(1) > 0 &&
                q_heads % k_buf.size(1) == 0, op, ": the cache buffers must be contiguous float32 [1, kv heads dividing ",
                q_heads, ", >= ", past + T, ", ", d, "]");
    TORCH_CHECK(mask.has_value() ? (mask->scalar_type() == at::kBool && mask->dim() >= 2 && mask->size(-2) == T &&
                                    mask->size(-1) == past + T && mask->numel() == T * (past + T)) : T == 1,
                op, ": T rows take a bool mask [.., T, past + T] (one row: none)");
    at::Tensor out = at::empty({1, T, q_heads * d}, q.options());
    const at::Tensor m = mask.has_value() ? mask->contiguous() : at::Tensor();
    attend_rows(q.data_ptr<float>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), k_buf.size(2), past, (int)T,
                mask.has_value() ? m.data_ptr<bool>() : nullptr, (int)q_heads, (int)k_buf.size(1), (int)d, (float)scale,
                out.data_ptr<float>());
    return out;
}

// q / k / v of the rows x [1, T, H] (after the norm) from one call, q and k rotated and k and v
// written to slots past.. of the cache buffers (rotate_and_cache) # -> q [1, heads, T, d], laid out
// as torch's rotary leaves it on the rows' views ([1, T, heads, d] memory: SDPA reads those strides).
at::Tensor rotated_q(const at::Tensor& x, at::TensorList weights, const std::optional<at::Tensor>* biases,
                     at::IntArrayRef sizes, const at::Tensor& cos, const at::Tensor& signed_sin, const at::Tensor& k_buf,
                     const at::Tensor& v_buf, int64_t past) {
    const int64_t T = x.size(1), q_heads = sizes[12], kv_heads = sizes[13], d = sizes[14];
    const at::Tensor heads = linear(x, weights, biases, sizes, 1);  // [1, T, q + 2 kv heads x d]
    const at::Tensor q = at::empty({1, T, q_heads, d}, x.options()).transpose(1, 2);  // [1, heads, T, d]
    rotate_and_cache(heads.data_ptr<float>(), cos.data_ptr<float>(), signed_sin.data_ptr<float>(), T, q_heads, kv_heads,
                     d, q.data_ptr<float>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), k_buf.size(2), past);
    return q;
}

// The attention of T > 1 rows q [1, heads, T, d] (rotated_q's) # -> [1, T, heads x d] before
// o_proj: lean_layers.py's multi-row path, SDPA under ``mask`` with grouped kv heads read in place
// (``gqa``: transformers' choice) or repeated.
at::Tensor attention_rows(const at::Tensor& q, at::IntArrayRef sizes, double scaling, const at::Tensor& k_buf,
                          const at::Tensor& v_buf, int64_t past, const at::Tensor& mask, bool gqa) {
    const int64_t T = q.size(2), q_heads = sizes[12], kv_heads = sizes[13], d = sizes[14];
    if (sizes[0] == PER_ROW) return row_attention(q[0].transpose(0, 1).contiguous(), k_buf, v_buf, past, mask, scaling);
    at::Tensor keys = k_buf.narrow(2, 0, past + T), values = v_buf.narrow(2, 0, past + T);
    const bool grouped = q_heads != kv_heads;
    if (grouped && !gqa) {
        keys = repeat_kv(keys, q_heads / kv_heads);
        values = repeat_kv(values, q_heads / kv_heads);
    }
    const at::Tensor attn = at::scaled_dot_product_attention(q, keys, values, mask, 0.0, false, scaling, grouped && gqa);
    return attn.reshape({1, -1, T, d}).transpose(1, 2).contiguous().reshape({1, T, -1}).contiguous();
}

// One decoder layer on the rows hidden [1, T, H] # -> [1, T, H] (checks its own arguments).
//   weights: [input norm, q|k|v fused, o, post-attention norm, gate|up fused, down] (norms: [H]);
//   biases: one per weight (the norms' none);
//   sizes: (format, n) of each of the six, then q heads, kv heads, head dim, half the rotary width,
//          the gate's width, where up starts, up's width; the norms' pairs unused but sizes[0], the
//          attention: SDPA (transformers' bits) or PER_ROW (row_attention.cpp: a row's bits whatever
//          the rows beside it; the int8 setting's);
//   scalars: the two norms' eps, the attention's scaling;
//   cos / signed_sin: the pass's rotary tables [1, 1, T, d] (signed: lean_layers._rolled_rotary's);
//   k_buf / v_buf: the layer's cache buffers [1, kv heads, capacity, d], ``past`` slots filled:
//   the rows' keys and values go to slots past.. (the caller moves the cache's length);
//   mask: none for one row (it sees every slot), [1, 1, T, past + T] bool for T > 1 (True: attend);
//   gqa: for T > 1, whether SDPA reads grouped kv heads in place (transformers' use_gqa_in_sdpa).
// Every row's q and k are rotated by one loop, k and v written to their slots directly
// (rotated_q); one row takes lean_layers.py's one-row attention, several rows its multi-row
// path (attention_rows).
at::Tensor layer_row(const at::Tensor& hidden, at::TensorList weights, const std::optional<at::Tensor>* biases,
                     at::IntArrayRef sizes, at::ArrayRef<double> scalars, const at::Tensor& cos,
                     const at::Tensor& signed_sin, const at::Tensor& k_buf, const at::Tensor& v_buf, int64_t past,
                     const std::optional<at::Tensor>& mask, bool gqa) {
    const char* op = "llama_row";
    check_rows(hidden, op);
    TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1 && hidden.size(1) >= 1 && hidden.size(1) <= MAX_ROWS, op,
                ": hidden must be [1, T <= ", MAX_ROWS, ", H], got ", hidden.sizes());
    const int64_t T = hidden.size(1), q_heads = sizes[12], kv_heads = sizes[13], head_dim = sizes[14], half = sizes[15];
    TORCH_CHECK(k_buf.dim() == 4 && v_buf.dim() == 4 && k_buf.size(0) == 1 && k_buf.size(1) == kv_heads &&
                k_buf.size(3) == head_dim && v_buf.sizes() == k_buf.sizes() && past >= 0 && past + T <= k_buf.size(2),
                op, ": the cache buffers must be [1, ", kv_heads, ", >= ", past + T, ", ", head_dim, "]");
    const int64_t width = (q_heads + 2 * kv_heads) * head_dim;
    for (const at::Tensor* table : {&cos, &signed_sin})
        TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 4 &&
                    table->size(2) == T && table->size(3) == head_dim && table->numel() == T * head_dim, op,
                    ": the rotary tables must be contiguous float32 [1, 1, ", T, ", ", head_dim, "]");
    TORCH_CHECK(k_buf.scalar_type() == at::kFloat && v_buf.scalar_type() == at::kFloat && k_buf.is_contiguous() &&
                v_buf.is_contiguous(), op, ": the cache buffers must be contiguous float32");
    TORCH_CHECK(2 * half == head_dim && sizes[3] == width && q_heads % kv_heads == 0, op,
                ": the fused q|k|v must give ", width, " outputs");
    TORCH_CHECK(sizes[0] == SDPA || sizes[0] == PER_ROW, op, ": sizes[0] (the attention) must be ", SDPA, " or ", PER_ROW);
    TORCH_CHECK(T == 1 ? !mask.has_value() : (mask.has_value() && mask->scalar_type() == at::kBool && mask->dim() == 4 &&
                mask->size(2) == T && mask->size(3) == past + T), op,
                ": one row takes no mask, T rows a bool mask [.., T, past + T]");
    // attention block: norm, q / k / v in one call, rotary, the cache's writes, SDPA, o_proj
    const at::Tensor x = rms_norm(hidden, weights[0], scalars[0]);
    const at::Tensor q = rotated_q(x, weights, biases, sizes, cos, signed_sin, k_buf, v_buf, past);  // [1, q, T, d]
    at::Tensor attn;
    if (T == 1) {
        attn = sizes[0] == PER_ROW ? row_attention(q.view({1, q_heads, head_dim}), k_buf, v_buf, past, std::nullopt, scalars[2])
               : at::scaled_dot_product_attention(q, k_buf.narrow(2, 0, past + 1), v_buf.narrow(2, 0, past + 1),
                                                  std::nullopt, 0.0, false, scalars[2], q_heads != kv_heads)  // [1, q, 1, d]
                     .transpose(1, 2).contiguous().view({1, 1, -1});
    } else {
        attn = attention_rows(q, sizes, scalars[2], k_buf, v_buf, past, *mask, gqa);
    }
    at::Tensor h = linear(attn, weights, biases, sizes, 2);
    add_into(h, hidden);
    // MLP block: norm, gate / up in one call, SiLU(gate) * up (the activation on contiguous rows), down
    const at::Tensor gate_up = linear(rms_norm(h, weights[3], scalars[1]), weights, biases, sizes, 4);
    const at::Tensor act = at::silu(gate_up.narrow(-1, 0, sizes[16]).contiguous()).mul_(gate_up.narrow(-1, sizes[17], sizes[18]));
    at::Tensor out = linear(act, weights, biases, sizes, 5);
    add_into(out, h);
    return out;
}

std::vector<std::optional<at::Tensor>> optionals(const c10::List<std::optional<at::Tensor>>& list) {
    std::vector<std::optional<at::Tensor>> out;
    out.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) out.push_back(list.get(i));
    return out;
}

// One layer (layer_row's arguments).
at::Tensor llama_row(const at::Tensor& hidden, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                     at::IntArrayRef sizes, at::ArrayRef<double> scalars, const at::Tensor& cos,
                     const at::Tensor& signed_sin, const at::Tensor& k_buf, const at::Tensor& v_buf, int64_t past,
                     const std::optional<at::Tensor>& mask, bool gqa) {
    TORCH_CHECK((int64_t)weights.size() == ROW_WEIGHTS && (int64_t)biases.size() == ROW_WEIGHTS &&
                (int64_t)sizes.size() == ROW_SIZES && (int64_t)scalars.size() == ROW_SCALARS,
                "llama_row: takes 6 weights, 6 biases, 19 sizes and 3 scalars");
    const auto b = optionals(biases);
    return layer_row(hidden, weights, b.data(), sizes, scalars, cos, signed_sin, k_buf, v_buf, past, mask, gqa);
}

// L layers one after the other (each layer's arguments of layer_row, concatenated in layer
// order; one cache buffer pair per layer, all with ``past`` slots filled) # -> the outputs of
// the layers listed in ``keep`` (indices, ascending), each [1, T, H], then, given the model's
// final RMSNorm (its weight [H] and eps), the last layer's output through it (LlamaRMSNorm's bits,
// as the layers' own norms): the step's last torch ops run here, not after it in Python.
std::vector<at::Tensor> llama_rows(const at::Tensor& hidden, at::TensorList weights,
                                   const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef sizes,
                                   at::ArrayRef<double> scalars, const at::Tensor& cos,
                                   const at::Tensor& signed_sin, at::TensorList k_bufs, at::TensorList v_bufs, int64_t past,
                                   const std::optional<at::Tensor>& mask, bool gqa, at::IntArrayRef keep,
                                   const std::optional<at::Tensor>& norm, double norm_eps) {
    const int64_t L = (int64_t)k_bufs.size();
    TORCH_CHECK(L > 0 && (int64_t)v_bufs.size() == L && (int64_t)weights.size() == ROW_WEIGHTS * L &&
                (int64_t)biases.size() == ROW_WEIGHTS * L && (int64_t)sizes.size() == ROW_SIZES * L &&
                (int64_t)scalars.size() == ROW_SCALARS * L, "llama_rows: takes per layer 6 weights, 6 biases, 19 sizes, ",
                "3 scalars and a cache buffer pair");
    const auto b = optionals(biases);
    std::vector<at::Tensor> out;
    at::Tensor h = hidden;
    size_t next = 0;
    for (int64_t i = 0; i < L; ++i) {
        h = layer_row(h, weights.slice(ROW_WEIGHTS * i, ROW_WEIGHTS), b.data() + ROW_WEIGHTS * i,
                      sizes.slice(ROW_SIZES * i, ROW_SIZES), scalars.slice(ROW_SCALARS * i, ROW_SCALARS), cos,
                      signed_sin, k_bufs[i], v_bufs[i], past, mask, gqa);
        if (next < keep.size() && keep[next] == i) {
            out.push_back(h);
            ++next;
        }
    }
    TORCH_CHECK(next == keep.size(), "llama_rows: keep must list layer indices below ", L, " in ascending order");
    if (norm.has_value()) out.push_back(rms_norm(h, *norm, norm_eps));
    return out;
}

// LlamaRMSNorm's forward as one op, its bits (x [..., H] contiguous and its weight [H], both
// float32 or both bfloat16; lean_layers.py's norm where its kernels are built).
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps) {
    TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) > 0 && x.is_contiguous() && w.is_contiguous() &&
                w.dim() == 1 && w.numel() == x.size(-1) && w.scalar_type() == x.scalar_type() &&
                (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "rms_norm: x [..., H] and the weight [H] "
                "must be contiguous CPU tensors, both float32 or both bfloat16");
    return x.scalar_type() == at::kFloat ? rms_norm(x, w, eps) : rms_norm_bf16(x, w, eps);
}

}  // namespace
