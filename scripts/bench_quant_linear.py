"""Our compiled GGUF-format linears beside torch's own quantised CPU matmuls, one linear at a time.

Per linear shape (SmolLM2-135M's by default) and row count M, the best of ``--reps`` interleaved
calls (ms) of:

- ``f_linear``: torch's ``F.linear`` on the dense float32 weight (the stock path);
- ``onednn``: oneDNN's prepacked float32 linear (``--cpu-linear packed``);
- ``ours_f32`` / ``ours_q4_1`` / ``ours_q8_0``: the compiled kernel (kernels/format_table.py) on
  float32 blocks and on the Q4_1 / Q8_0 codes;
- ``torch_int4``: ``torch._weight_int4pack_mm_for_cpu`` on the *same* Q4_1 weight (group 32:
  Q4_1's ``d * q + m`` is torch's ``(q - 8) * scale + zero`` with ``zero = m + 8 d``);
- ``torch_int8``: ``torch._weight_int8pack_mm``: int8 codes with one scale per output row (the
  only layout it takes), so its weight is a per-row quantisation of the Q8_0 weight's shape, not
  the Q8_0 weight itself: the same bytes per weight, other values.
- ``torch_int4_bf16`` / ``torch_int8_bf16``: the same two with bfloat16 activations and scales,
  the dtype torch's fast CPU paths for them are written for (float32 activations take a slow
  path); their results round to bfloat16, so they are not exact.

Each row also records how far each fast result lies from the float64 product of its own weight
(``err_*``): ours keep the exactness contract (docs/kernels.md), torch's int4 path rounds on
its own terms.

    python scripts/bench_quant_linear.py --threads 1 --out bench_quant_linear.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from multitoken.kernels.format_table import FORMATS
from multitoken.pipeline.eval.benchmark import Bench, add_out, best_of

# SmolLM2-135M's linears: (name, out_features, in_features)
SMOLLM2 = (("q_proj", 576, 576), ("k_proj", 192, 576), ("gate_proj", 1536, 576), ("down_proj", 576, 1536),
           ("lm_head", 49152, 576))
GROUP = 32  # GGUF's block of 32 weights: Q4_1's and Q8_0's scale groups


def q4_1_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight whose values are exactly Q4_1's: (weight [N, K], codes [N, K] int32, d, m [N, K/32])."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    codes.view(n, k // GROUP, GROUP)[..., :2] = torch.tensor([0, 15], dtype=torch.int32)  # each block spans 0..15, as GGUF's quantiser makes it
    d = (torch.rand(n, k // GROUP, generator=gen) * 0.004 + 0.001).half().float()
    m = (-torch.rand(n, k // GROUP, generator=gen) * 0.03).half().float()
    weight = (codes.view(n, k // GROUP, GROUP).float() * d[..., None] + m[..., None]).view(n, k)
    return weight, codes, d, m


def q8_0_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A weight whose values are exactly Q8_0's # [N, K]: fp16 d times int8 codes per 32."""
    codes = torch.randint(-127, 128, (n, k // GROUP, GROUP), generator=gen).float()
    codes[..., 0] = 127  # each block reaches its scale's end, as GGUF's quantiser makes it
    d = (torch.rand(n, k // GROUP, 1, generator=gen) * 0.0003 + 0.0001).half().float()
    return (codes * d).view(n, k)


def per_row_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_int8's operands # [N, K] -> (int8 [N, K], scales [N]): one scale per output row."""
    scales = weight.abs().amax(1).clamp_min(1e-12) / 127
    return torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8), scales


def calls_for(n: int, k: int, x: torch.Tensor, gen: torch.Generator) -> tuple[dict, dict]:
    """(label -> call, label -> float64 reference of that call's own weight) for one shape."""
    w4, codes4, d4, m4 = q4_1_weight(n, k, gen)
    w8 = q8_0_weight(n, k, gen)
    i8, s8 = per_row_int8(w8)
    scale_zero = torch.stack([d4.T, (m4 + 8 * d4).T], -1).contiguous()  # [K/32, N, 2]
    int4 = torch._convert_weight_to_int4pack_for_cpu(codes4, 2)
    xb, scale_zero_bf16, s8_bf16 = x.bfloat16(), scale_zero.bfloat16(), s8.bfloat16()
    packed = {"f32": FORMATS["f32"].pack(w4), "q4_1": FORMATS["q4_1"].pack(w4), "q8_0": FORMATS["q8_0"].pack(w8),
              "onednn": FORMATS["onednn"].pack(w4)}
    calls = {"f_linear": lambda: F.linear(x, w4), "onednn": lambda: FORMATS["onednn"].linear(x, packed["onednn"], n, None),
             "torch_int4": lambda: torch._weight_int4pack_mm_for_cpu(x, int4, GROUP, scale_zero),
             "torch_int8": lambda: torch._weight_int8pack_mm(x, i8, s8),
             "torch_int4_bf16": lambda: torch._weight_int4pack_mm_for_cpu(xb, int4, GROUP, scale_zero_bf16),
             "torch_int8_bf16": lambda: torch._weight_int8pack_mm(xb, i8, s8_bf16)}
    for name in ("f32", "q4_1", "q8_0"):
        if packed[name] is not None:  # None: the compiled kernel is not built here
            calls[f"ours_{name}"] = (lambda name: lambda: FORMATS[name].linear(x, packed[name], n, None))(name)
    q4_ref = F.linear(x.double(), w4.double())
    refs = {"f_linear": q4_ref, "onednn": q4_ref, "torch_int4": q4_ref, "ours_f32": q4_ref, "ours_q4_1": q4_ref,
            "ours_q8_0": F.linear(x.double(), w8.double()),
            "torch_int8": F.linear(x.double(), (i8.double() * s8.double()[:, None]))}
    refs.update(torch_int4_bf16=q4_ref, torch_int8_bf16=refs["torch_int8"])
    return calls, refs


def run_shape(name: str, n: int, k: int, rows: list[int], reps: int) -> dict:
    out = {}
    for m in rows:
        gen = torch.Generator().manual_seed(n * 7 + k + m)
        x = torch.randn(m, k, generator=gen)
        calls, refs = calls_for(n, k, x, gen)
        best = best_of({label: (lambda call: lambda: (call(), {})[1])(call) for label, call in calls.items()}, reps)
        row = {label: round(best[label]["wall_s"] * 1e3, 4) for label in calls}
        row.update({f"err_{label}": float((call().double() - refs[label]).abs().max()) for label, call in calls.items()})
        out[m] = row
        print(f"{name:10s} {n:5d}x{k:<5d} M={m}: " + "  ".join(f"{label} {row[label]:.3f}" for label in calls), flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=20, help="interleaved timed calls per method (best kept)")
    p.add_argument("--rows", default="1,3,9", help="row counts M (comma separated)")
    p.add_argument("--shapes", default=",".join(s[0] for s in SMOLLM2), help="SmolLM2-135M linears to time")
    add_out(p, "bench_quant_linear.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = {s[0]: s for s in SMOLLM2}
    unknown = [s for s in args.shapes.split(",") if s not in shapes]
    if unknown:
        raise SystemExit(f"error: unknown --shapes {','.join(unknown)}; choose from {','.join(shapes)}")
    bench = Bench("quant_linear", args, threads=args.threads, reps=args.reps, rows=args.rows)
    bench["results"] = {}
    for name in args.shapes.split(","):
        _, n, k = shapes[name]
        bench["results"][name] = run_shape(name, n, k, [int(r) for r in args.rows.split(",")], args.reps)
        bench.save()
    return bench.save()


if __name__ == "__main__":
    main()
