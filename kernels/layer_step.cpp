// A Llama decoder layer's one-row step as one op (ops.cpp includes this after ``gemv``): the ops
// of pipeline/model/lean_layers.py's one-row path, in its order, called from C++.
//
// Why: a one-token decoding step of a small model is mostly the Python between ~40 small ops per
// layer (docs/benchmarks/profile.md). Here those ops are the same ATen ops on the same tensors
// (the dispatcher picks the same kernels), and the linears the same ``gemv`` calls, so every
// output is the Python path's, bit for bit (tests/pipeline/test_lean_layers.py); only the
// interpreter between them is gone. lean_layers.py decides where this applies (one row, float32,
// SDPA attention, RMSNorm, SiLU, every linear packed in a compiled format, a KV cache buffer with
// room for the row) and keeps the cache's length.
#include <ATen/TensorOperators.h>
#include <ATen/record_function.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>

namespace {

// LlamaRMSNorm's ops on float32 x (its casts are no-ops there): w * (x * rsqrt(mean(x^2) + eps)).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
    at::Tensor variance = x.pow(2).mean({-1}, true);
    return w * (x * variance.add(eps).rsqrt());
}

#define MT_NAME(ns) #ns
#define MT_OP_NAME(ns, op) MT_NAME(ns) "::" op

// Linear ``i`` of a layer: weights[i], formats / ns in sizes, its bias (or none). Called directly,
// not through the dispatcher: recorded under the op's name for a profiler (free when none runs).
at::Tensor linear(const at::Tensor& x, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                  at::IntArrayRef sizes, int64_t i) {
    RECORD_FUNCTION(MT_OP_NAME(MT_NAMESPACE, "gemv"), std::vector<c10::IValue>());
    const std::optional<at::Tensor> bias = biases.get(i);
    return gemv(x, weights[i], sizes[2 * i], sizes[2 * i + 1], bias);
}

// One decoder layer on one row hidden [1, 1, H] # -> [1, 1, H].
//   weights: [input norm, q|k|v fused, o, post-attention norm, gate|up fused, down] (norms: [H]);
//   biases: one per weight (the norms' none);
//   sizes: (format, n) of each of the six (the norms' unused), then q heads, kv heads, head dim,
//          half the rotary width, the gate's width, where up starts, up's width;
//   scalars: the two norms' eps, the attention's scaling;
//   cos / signed_sin: the pass's rotary tables [1, 1, 1, d] (lean_layers._rolled_rotary);
//   k_buf / v_buf: the layer's cache buffers [1, kv heads, capacity, d], ``past`` slots filled:
//   the row's key and value go to slot ``past`` (the caller moves the cache's length).
at::Tensor llama_row(const at::Tensor& hidden, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                     at::IntArrayRef sizes, at::ArrayRef<double> scalars, const at::Tensor& cos,
                     const at::Tensor& signed_sin, const at::Tensor& k_buf, const at::Tensor& v_buf, int64_t past) {
    const char* op = "llama_row";
    TORCH_CHECK(weights.size() == 6 && biases.size() == 6 && sizes.size() == 19 && scalars.size() == 3, op,
                ": takes 6 weights, 6 biases, 19 sizes and 3 scalars");
    check_rows(hidden, op);
    TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1 && hidden.size(1) == 1, op, ": hidden must be [1, 1, H], got ",
                hidden.sizes());
    const int64_t q_heads = sizes[12], kv_heads = sizes[13], head_dim = sizes[14], half = sizes[15];
    TORCH_CHECK(k_buf.dim() == 4 && v_buf.dim() == 4 && k_buf.size(0) == 1 && k_buf.size(1) == kv_heads &&
                k_buf.size(3) == head_dim && v_buf.sizes() == k_buf.sizes() && past >= 0 && past < k_buf.size(2),
                op, ": the cache buffers must be [1, ", kv_heads, ", > ", past, ", ", head_dim, "]");
    // attention block: norm, q / k / v in one call, rotary on q and k as one tensor, the cache, SDPA
    at::Tensor x = rms_norm(hidden, weights[0], scalars[0]);
    at::Tensor heads = linear(x, weights, biases, sizes, 1).view({1, 1, -1, head_dim}).transpose(1, 2);  // [1, q + 2 kv, 1, d]
    at::Tensor qk = heads.narrow(1, 0, q_heads + kv_heads);
    qk = (qk * cos) + (qk.roll(half, -1) * signed_sin);
    k_buf.narrow(2, past, 1).copy_(qk.narrow(1, q_heads, kv_heads));
    v_buf.narrow(2, past, 1).copy_(heads.narrow(1, q_heads + kv_heads, kv_heads));
    at::Tensor attn = at::scaled_dot_product_attention(qk.narrow(1, 0, q_heads), k_buf.narrow(2, 0, past + 1),
                                                       v_buf.narrow(2, 0, past + 1), std::nullopt, 0.0, false, scalars[2],
                                                       q_heads != kv_heads);  // [1, q, 1, d]
    attn = attn.reshape({1, -1, 1, head_dim}).transpose(1, 2).contiguous().reshape({1, 1, -1}).contiguous();
    at::Tensor h = hidden + linear(attn, weights, biases, sizes, 2);
    // MLP block: norm, gate / up in one call, SiLU(gate) * up, down
    at::Tensor gate_up = linear(rms_norm(h, weights[3], scalars[1]), weights, biases, sizes, 4);
    at::Tensor act = at::silu(gate_up.narrow(-1, 0, sizes[16])) * gate_up.narrow(-1, sizes[17], sizes[18]);
    return h + linear(act, weights, biases, sizes, 5);
}

}  // namespace
