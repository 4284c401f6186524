"""The multi-row unembedding cliff: ms per call of logits for R rows against a [V, H] weight,
three ways -- F.linear over all R rows, F.linear in calls of at most 3 rows, and (W @ x^T)^T --
on pythia-160m / 410m shapes (random fp32 weights: cost only). Decoding no longer relies on a
fixed rule: pipeline/runtime/unembed_costs.py measures the same forms per backbone, dtype and thread
count when a row count is first needed (bench_decode.py records those costs).

Where the compiled rows kernel builds (``--cpu-linear rows``, the default), ``gemv_rows`` times its
logits and ``rows_argmax`` the argmax screen greedy decoding reads instead (the same argmax: an
int8 copy read in full, the tokens near the best computed exactly; ``rows_exact`` counts those).
``rows_q8_grid`` times the logits of the same weight put on a Q8_0 grid (as a GGUF's embedding is)
and read from its codes (gguf_codes.py; asserted bit-identical to the kernel's float blocks of
that weight); ``rows_q8_argmax`` the exact argmax greedy steps take from those codes (the int16
screen, argmax_prefilter.cpp; AVX512-VNNI builds).

As a reference for what the machine can do, ``compiled_loop`` times a plain numba loop (one dot
product per row and token, fastmath; needs the ``[fast]`` extra): where it is far below
``linear``, the BLAS's skinny GEMM, not the memory, sets the cost. ``--pythia-mini-heads DIR``
then asks what that does to a speed-up: transformers' greedy ``generate``, our ``ar`` and greedy
speculative decoding on pythia-mini, first with the stock unembedding, then with the compiled
loop put in as the model's output embeddings (``set_output_embeddings``, so that both sides use
it). Benchmark only: the library keeps torch's unembedding. Run on a quiet machine:

    python scripts/bench_unembed.py --threads 1 --out bench_unembed.json [--pythia-mini-heads DIR]
"""

from __future__ import annotations

import argparse

import numpy
import torch
import torch.nn.functional as F

from multitoken.decoding.config import DecodeConfig
from multitoken.kernels import cpu_linear, gguf_codes, gemv_rows
from multitoken.pipeline.eval.benchmark import (FIXTURES, PROMPTS, Bench, add_out, best_of, hf_runner, load, our_runner,
                                                over_prompts)

SHAPES = {"pythia-160m": (50304, 768), "pythia-410m": (50304, 1024), "pythia-mini": (50304, 128), "smollm2": (49152, 576)}


def compiled_loop():
    """logits(x [R, H], w [V, H]) -> [R, V] by a numba loop, or None without numba."""
    try:
        import numba
    except ImportError:
        return None

    @numba.njit(fastmath=True, cache=True)
    def rows_dot(x, w, out):  # per token, every row's dot product while its weight row is in L1
        for v in range(w.shape[0]):
            for r in range(x.shape[0]):
                acc = numpy.float32(0.0)
                for h in range(x.shape[1]):
                    acc += x[r, h] * w[v, h]
                out[r, v] = acc

    def logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0])
        rows_dot(x.contiguous().numpy(), w.numpy(), out.numpy())
        return out
    return logits


class LoopUnembedding(torch.nn.Module):
    """The compiled loop as a model's output embeddings (inference, fp32 CPU rows)."""

    def __init__(self, head: torch.nn.Linear, logits):
        super().__init__()
        self.weight, self.logits = head.weight, logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        return self.logits(rows, self.weight.detach()).reshape(*x.shape[:-1], -1)


def decode_rows(heads: str, max_new: int, reps: int) -> dict:
    """tok/s of transformers' greedy generate, ``ar`` and speculative greedy on pythia-mini,
    with the stock and then the compiled unembedding on both sides."""
    model, _ = load(str(FIXTURES / "pythia-mini"), heads)
    ids = [model.backbone.tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS["pile"]]
    runners = {"hf_greedy": hf_runner(model, False, max_new),
               "ar": our_runner(model, DecodeConfig(mode="ar", greedy=True, max_new_tokens=max_new), None),
               "speculative_greedy": our_runner(model, DecodeConfig(mode="speculative", greedy=True, drafter="independent",
                                                                    max_new_tokens=max_new), None)}
    out, reference = {}, None
    lm = model.backbone.causal_lm
    stock = lm.get_output_embeddings()
    for label, head in (("stock", stock), ("compiled_loop", LoopUnembedding(stock, compiled_loop()))):
        lm.set_output_embeddings(head)
        timed = best_of({name: (lambda run: lambda: over_prompts(run, ids))(run) for name, run in runners.items()}, reps)
        best = {name: r["tokens"] / r["wall_s"] for name, r in timed.items()}
        texts = {name: r["outputs"] for name, r in timed.items()}
        reference = reference or texts["hf_greedy"]  # the stock transformers output
        out[label] = {name: {"tokens_per_s": round(v, 1), "x_hf_greedy": round(v / best["hf_greedy"], 3),
                             "identical_to_stock_hf": texts[name] == reference} for name, v in best.items()}
        print(f"pythia-mini, {label} unembedding: " + "  ".join(f"{n} {r['tokens_per_s']} tok/s (x{r['x_hf_greedy']}{'' if r['identical_to_stock_hf'] else ', differs'})"
                                                              for n, r in out[label].items()), flush=True)
    lm.set_output_embeddings(stock)
    return out


def calls_ms(calls: dict, reps: int) -> dict[str, float]:
    """ms of each call's fastest repetition (the calls interleaved, after a warm-up of each)."""
    best = best_of({name: (lambda fn: lambda: (fn(), {})[1])(fn) for name, fn in calls.items()}, reps)
    return {name: 1000 * r["wall_s"] for name, r in best.items()}


def on_q8(w: torch.Tensor) -> torch.Tensor:
    """``w`` [V, H] quantized to Q8_0 (blocks of 32 inputs, a float16 scale each) and dequantized."""
    b = w.reshape(w.shape[0], -1, gguf_codes.QK)
    d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.round(b / torch.where(d > 0, d, 1.0)).clamp(-127, 127) + 0.0  # +0.0: integer codes, no -0.0
    return (q * d).reshape(w.shape)


def check_exact(x, w, v: int, blocked, screen, grid, codes, l1, row: dict) -> None:
    """The timed fast calls give the plain results: the screen's argmax is the logits', the Q8
    codes' logits are bit-identical to the kernel's float blocks of the same weight."""
    if blocked is not None:
        best, exact = gemv_rows.argmax(x, blocked, screen, v)
        assert torch.equal(best, gemv_rows.linear(x, blocked, v, None).argmax(-1))
        row["rows_exact"] = exact
    if codes is not None:
        same = gemv_rows.linear(x, gemv_rows.block_weight(grid), v, None)
        assert torch.equal(gguf_codes.linear(x, codes, gguf_codes.Q8, v, None).view(torch.int32), same.view(torch.int32))
        if "rows_q8_argmax" in row:
            assert torch.equal(gguf_codes.q8_argmax(x, codes, v, l1), same.argmax(-1))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rows", default="1,2,3,4,5,6,9")
    p.add_argument("--shapes", default=",".join(SHAPES))
    add_out(p, "bench_unembed.json")
    p.add_argument("--pythia-mini-heads", default=None, help="trained pythia-mini heads: also time decoding with either unembedding")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bench = Bench("unembed", args, reps=args.reps, rows=args.rows)
    record = bench.record
    record["results"] = {}
    loop = compiled_loop()
    kernel = cpu_linear.rows_usable()
    for shape in args.shapes.split(","):
        v, h = SHAPES[shape]
        w = torch.randn(v, h) * 0.02
        blocked = gemv_rows.block_weight(w) if kernel else None
        screen = gemv_rows.screen_weight(blocked) if kernel else None
        grid = on_q8(w) if kernel and cpu_linear.grids_on() else None
        codes = gguf_codes.pack(*gguf_codes.find_codes(grid)) if grid is not None else None
        l1 = gguf_codes.l1_norms(codes, v) if codes is not None else None
        rows_out = {}
        for r in map(int, args.rows.split(",")):
            x = torch.randn(r, h)
            calls = {"linear": lambda: F.linear(x, w), "linear_3row_calls": lambda: [F.linear(c, w) for c in x.split(3)],
                     "transposed": lambda: (w @ x.T).T}
            if loop is not None:
                calls["compiled_loop"] = lambda: loop(x, w)
            if kernel:
                calls["rows_kernel"] = lambda: gemv_rows.linear(x, blocked, v, None)
                calls["rows_argmax"] = lambda: gemv_rows.argmax(x, blocked, screen, v)
            if codes is not None:
                calls["rows_q8_grid"] = lambda: gguf_codes.linear(x, codes, gguf_codes.Q8, v, None)
                if gguf_codes.q8_argmax(x, codes, v, l1) is not None:  # AVX512-VNNI builds
                    calls["rows_q8_argmax"] = lambda: gguf_codes.q8_argmax(x, codes, v, l1)
            rows_out[r] = calls_ms(calls, args.reps)
            check_exact(x, w, v, blocked, screen, grid, codes, l1, rows_out[r])
            print(f"{shape:12s} rows {r}: " + "  ".join(f"{k} {ms:7.2f}" + ("" if k == "rows_exact" else " ms")
                                                        for k, ms in rows_out[r].items()), flush=True)
        record["results"][shape] = rows_out
    if args.pythia_mini_heads:
        record["pythia_mini_decode"] = decode_rows(args.pythia_mini_heads, args.max_new_tokens, 3)
    return bench.save()


if __name__ == "__main__":
    main()
