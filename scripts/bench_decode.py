"""Decoding benchmark: tokens/s of transformers' greedy ``generate`` and prompt-lookup decoding
against our ``ar``, ``speculative`` (greedy); of transformers' sampling ``generate`` (``hf_sample``)
against our ``ar`` sampling (``ar_sample``) and ``dynamic`` (eps_b 0.25 / 0.5 / 0.75 / 1), all
sampled rows at the same temperature, top-k and repetition penalty (transformers' penalty is its
logit form: a seen token's logit divided by the penalty if positive, else multiplied, before
temperature and top-k; ours is DynaMo's: the probability divided after them); on the embedded
stories260K model with its heads and on pythia-mini with heads.

Every method decodes the same prompts; each repetition runs the methods interleaved and the best
repetition counts (the machine may be shared). Prints a table and writes the harness's JSON
record (``multitoken.pipeline.eval.benchmark``).

    python scripts/bench_decode.py --out bench_decode.json [--pythia-heads DIR] [--device cuda --dtype bfloat16]
    python scripts/bench_decode.py --shapes 160m 410m --out bench_shapes.json   # step cost only
    python scripts/bench_decode.py --shapes 410m --shape-dtypes float32 bfloat16 --out bench_shapes.json

The batch bench is ``scripts/bench_batches.py``; the per-step DynaMo logic timing
``scripts/bench_logic.py``.

``--shapes``: only the step-cost bench on random-weight GPT-NeoX models of pythia-160m / 410m
shapes (no download) with 3 random replicated heads: per mode model and logic ms per step,
tokens per forward, ms per token and the step-cost ratio over an ``ar`` step (the goal:
<= 1.2x for dynamic and speculative on 410m).

Our rows run with ``generate(profile=True)``: on an accelerator the model / logic split then
synchronises the device at every clock reading.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.embedded import DEFAULT_BASE
from multitoken.pipeline.eval.benchmark import (PROMPTS, PYTHIA_SHAPES, Bench, add_out, best_of, decode_arguments,
                                                hf_runner, load, open_table, our_runner, over_prompts, random_lm,
                                                sampling)
from multitoken.pipeline.model.backbone import Backbone
from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.pipeline.runtime.unembed_costs import costs_for
from multitoken.stats.table import CooccurrenceTable


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "bench_decode.json")
    decode_arguments(p, None)
    p.add_argument("--shapes", nargs="+", choices=PYTHIA_SHAPES, default=None,
                   help="only the step-cost bench on random-weight models of these pythia shapes")
    p.add_argument("--shape-prompt", type=int, default=64, help="random prompt tokens (--shapes)")
    p.add_argument("--shape-dtypes", nargs="+", default=None, choices=("float32", "bfloat16", "float16"),
                   help="--shapes in each of these dtypes, one after the other (default: --dtype); bfloat16 takes "
                        "oneDNN's multi-row matmuls where the CPU has AVX512-BF16")
    p.add_argument("--shape-stats", default=None, help="a stats dir over a 50304-token vocabulary (the pythia "
                   "tokenizer) for a masked dynamic row (--shapes; default: unmasked dynamic only)")
    args = p.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 32 if args.shapes else 128
    return args


def bench_model(name, model, heads_label, table, prompts, args) -> dict:
    tok = model.backbone.tokenizer
    ids = [tok(p, return_tensors="pt").input_ids for p in prompts]
    n = model.n_future
    base = dict(max_new_tokens=args.max_new_tokens, n=n)
    sample = sampling(args)
    methods = {
        "hf_greedy": hf_runner(model, False, args.max_new_tokens),
        "hf_prompt_lookup": hf_runner(model, True, args.max_new_tokens),
        "ar": our_runner(model, DecodeConfig(mode="ar", greedy=True, max_new_tokens=args.max_new_tokens), table),
        "speculative_greedy": our_runner(model, DecodeConfig(mode="speculative", greedy=True, **base), table),
        # two tokens per pass at most, but one head layer fewer per verification pass
        "speculative_greedy_n2": our_runner(model, DecodeConfig(mode="speculative", greedy=True, **{**base, "n": min(2, n)}), table),
    }
    # sampled rows: one setting for all (seed 0); ar_sample is the baseline of the dynamic rows
    methods["hf_sample"] = hf_runner(model, False, args.max_new_tokens, sample)
    methods["ar_sample"] = our_runner(model, DecodeConfig(mode="ar", max_new_tokens=args.max_new_tokens, **sample), table)
    for eps in (0.25, 0.5, 0.75, 1.0):
        methods[f"dynamic_eps{eps}"] = our_runner(model, DecodeConfig(mode="dynamic", eps_b=eps, **base, **sample), table)
    best = best_of({label: (lambda run: lambda: over_prompts(run, ids))(run) for label, run in methods.items()}, args.reps)
    rows = {}
    speed = {label: r["tokens"] / r["wall_s"] for label, r in best.items()}
    for label, r in best.items():
        row = {"tokens": r["tokens"], "wall_s": round(r["wall_s"], 4), "tokens_per_s": round(speed[label], 1),
               "speedup_vs_hf_greedy": round(speed[label] / speed["hf_greedy"], 3)}
        if label == "hf_sample" or label.endswith("_sample") or label.startswith("dynamic"):
            row["speedup_vs_ar_sample"] = round(speed[label] / speed["ar_sample"], 3)
        if r["traces"][0] is not None:
            fw = sum(t.forward_passes for t in r["traces"])
            row.update(forward_passes=fw, tokens_per_forward=round(r["tokens"] / fw, 3),
                       model_s=round(sum(t.model_s for t in r["traces"]), 4),
                       decoding_logic_s=round(sum(t.decoding_s for t in r["traces"]), 4),
                       logic_ms_per_forward=round(1000 * sum(t.decoding_s for t in r["traces"]) / fw, 3),
                       unembed_rows=dict(sorted(sum((t.unembed_rows for t in r["traces"]), Counter()).items())))
        if label in ("ar", "speculative_greedy", "speculative_greedy_n2", "hf_prompt_lookup"):
            row["identical_to_hf_greedy"] = r["outputs"] == best["hf_greedy"]["outputs"]
        rows[label] = row
    return {"model": name, "heads": heads_label, "stats": bool(table), "n": n, "prompts": prompts, "sampling": sample,
            "unembed_costs_ms": unembed_costs_ms(model),
            "hf_sample_penalty": "transformers' logit form (logit / penalty if > 0, else x penalty, before temperature and top-k)",
            "methods": rows}


def pythia_shaped(shape: str, device: str, dtype: str, cpu_linear: str) -> MultiTokenModel:
    """A random-weight GPT-NeoX of a pythia shape with 3 random replicated heads: cost, not quality."""
    bb = Backbone(random_lm(shape), None, f"pythia-{shape}-shaped (random)",
                  BackboneConfig(base="random", cpu_linear=cpu_linear))
    model = MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "random"})
    return model.to(device=device, dtype=getattr(torch, dtype)).eval()  # packed by the first decode


def unembed_costs_ms(model) -> dict:
    """The unembedding costs this process measured for ``model`` (ms per call, per row count and
    form; empty on an accelerator: one call, nothing measured)."""
    bb = model.backbone
    probe = torch.empty(1, bb.hidden_size, dtype=bb.unembedding.weight.dtype, device=bb.device)
    return costs_for(bb.unembedding, probe).as_dict()


def step_row(traces: list) -> dict:
    """Per-step costs of a mode from its traces (prefill excluded: a step is a forward pass after
    the prompt's; the model share includes the head distributions it reads)."""
    steps = sum(t.forward_passes - 1 for t in traces)
    tokens = sum(t.new_tokens for t in traces)
    model = sum(t.model_s - t.prefill_s for t in traces)
    wall = sum(t.wall_s - t.prefill_s for t in traces)
    if steps == 0:
        raise SystemExit("--max-new-tokens is too small for a step after the prompt's pass: pass at least 8")
    return {"steps": steps, "tokens": tokens, "model_ms_per_step": 1000 * model / steps,
            "logic_ms_per_step": 1000 * (wall - model) / steps, "ms_per_step": 1000 * wall / steps,
            "tokens_per_forward": tokens / sum(t.forward_passes for t in traces), "ms_per_token": 1000 * wall / tokens,
            "unembed_rows": dict(sorted(sum((t.unembed_rows for t in traces), Counter()).items())),
            "dynamic_kernel": dict(sum((t.dynamic_kernel for t in traces), Counter()))}


def bench_shapes(args) -> dict:
    """Each shape decodes ``--max-new-tokens`` from a random ``--shape-prompt``-token prompt in
    every mode (interleaved per repetition, the fastest repetition of each kept); the step-cost
    ratio is a mode's ms per step over ``ar``'s (the goal: <= 1.2 on 410m)."""
    sample = sampling(args)
    base = dict(max_new_tokens=args.max_new_tokens, n=3, stop_at_eos=False)
    out = {}
    for shape, dtype in [(shape, dtype) for shape in args.shapes for dtype in args.shape_dtypes or [args.dtype]]:
        model = pythia_shaped(shape, args.device, dtype, args.cpu_linear)
        prompt = torch.randint(0, 50304, (1, args.shape_prompt), generator=torch.Generator().manual_seed(1))
        table = CooccurrenceTable(args.shape_stats) if args.shape_stats else None
        modes = {"ar": DecodeConfig(mode="ar", greedy=True, max_new_tokens=args.max_new_tokens, stop_at_eos=False),
                 "speculative_greedy": DecodeConfig(mode="speculative", greedy=True, **base),
                 # eps_b 0: the full order-3 grid every step (3 tokens per forward), the costliest logic
                 "dynamic_eps0": DecodeConfig(mode="dynamic", eps_b=0.0, **base, **sample)}
        tables = {label: None for label in modes}
        if table is not None:
            modes["dynamic_eps0_masked"], tables["dynamic_eps0_masked"] = modes["dynamic_eps0"], table
        # the warm-up also lets the unembedding's cost table measure its row counts; a step's time is the
        # score (the prompt's pass is not a step)
        best = best_of({label: (lambda cfg, t: lambda: _stepped(model, prompt, cfg, t))(cfg, tables[label])
                        for label, cfg in modes.items()}, args.reps, score=lambda r: r["per_step"])
        traces = {label: [r["trace"]] for label, r in best.items()}
        rows = {label: step_row(t) for label, t in traces.items()}
        for row in rows.values():
            row["step_cost_vs_ar"] = row["ms_per_step"] / rows["ar"]["ms_per_step"]
            row["model_cost_vs_ar"] = row["model_ms_per_step"] / rows["ar"]["model_ms_per_step"]
        out[shape if dtype == "float32" else f"{shape}-{dtype}"] = {"model": model.backbone.name, "dtype": dtype,
                      "unembed_costs_ms": unembed_costs_ms(model),
                      "prompt_tokens": args.shape_prompt, "stats": args.shape_stats, "sampling": sample, "modes": rows}
        del model
    return out


def _stepped(model, prompt, cfg: DecodeConfig, table) -> dict:
    trace = generate(model, prompt, cfg, table=table, profile=True).trace
    return {"trace": trace, "per_step": (trace.wall_s - trace.prefill_s) / max(trace.forward_passes - 1, 1)}


def print_shapes(shapes: dict) -> None:
    for shape, r in shapes.items():
        print(f"\npythia-{shape}-shaped (random weights, 3 replicated heads, {r['dtype']}), prompt {r['prompt_tokens']} tokens")
        print(f"{'mode':20s} {'model ms/step':>13s} {'logic ms/step':>13s} {'tok/fwd':>8s} {'ms/token':>9s} "
              f"{'step x ar':>9s} {'model x ar':>10s}  rows/unembed call")
        for label, m in r["modes"].items():
            print(f"{label:20s} {m['model_ms_per_step']:13.3f} {m['logic_ms_per_step']:13.3f} {m['tokens_per_forward']:8.2f} "
                  f"{m['ms_per_token']:9.3f} {m['step_cost_vs_ar']:9.3f} {m['model_cost_vs_ar']:10.3f}  {m['unembed_rows']}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    bench = Bench("decode", args, device=args.device, dtype=args.dtype, cpu_linear=args.cpu_linear,
                  max_new_tokens=args.max_new_tokens, reps=args.reps, warm_up_runs=1)
    if args.shapes:  # the bigger shapes alone
        bench["shapes"] = bench_shapes(args)
        print_shapes(bench["shapes"])
        return bench.save()
    emb, emb_heads = load(str(DEFAULT_BASE), args.embedded_heads, args.device, args.dtype, args.cpu_linear)
    bench["embedded"] = bench_model("stories260K (embedded)", emb, emb_heads,
                                    open_table(args.embedded_stats, emb.backbone.tokenizer), PROMPTS["stories"], args)
    bench.save()  # a long run stopped keeps what it measured
    pm, pm_heads = load(args.pythia_mini, args.pythia_heads, args.device, args.dtype, args.cpu_linear)
    bench["pythia_mini"] = bench_model("pythia-mini", pm, pm_heads, open_table(args.pythia_stats, pm.backbone.tokenizer),
                                       PROMPTS["pile"], args)
    record = bench.save()
    print_table(record)
    return record


def print_table(record: dict) -> None:
    for key in ("embedded", "pythia_mini"):
        r = record[key]
        print(f"\n{r['model']}  heads: {r['heads']}  stats: {r['stats']}")
        print(f"sampled rows: {r['sampling']}; hf_sample's penalty: {r['hf_sample_penalty']}")
        print(f"{'method':22s} {'tok/s':>8s} {'x HF':>6s} {'x ar_s':>6s} {'tok/fwd':>8s} {'logic ms/fwd':>13s} identical")
        for label, m in r["methods"].items():
            print(f"{label:22s} {m['tokens_per_s']:8.1f} {m['speedup_vs_hf_greedy']:6.2f} {m.get('speedup_vs_ar_sample', float('nan')):6.2f} "
                  f"{m.get('tokens_per_forward', float('nan')):8.2f} {m.get('logic_ms_per_forward', float('nan')):13.3f} "
                  f"{m.get('identical_to_hf_greedy', '')}")
    print(f"{record['machine']['cpu']}, {record['machine']['torch_threads']} torch threads, "
          f"load average before / after {record['load_before']} / {record['load_after']}")


if __name__ == "__main__":
    main()
