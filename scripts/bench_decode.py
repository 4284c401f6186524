"""Decoding benchmark: tokens/s of transformers' greedy ``generate`` and prompt-lookup decoding
against our ``ar``, ``speculative`` (greedy); of transformers' sampling ``generate`` (``hf_sample``)
against our ``ar`` sampling (``ar_sample``) and ``dynamic`` (eps_b 0.25 / 0.5 / 0.75 / 1), all
sampled rows at the same temperature, top-k and repetition penalty (transformers' penalty is its
logit form: a seen token's logit divided by the penalty if positive, else multiplied, before
temperature and top-k; ours is DynaMo's: the probability divided after them); on the embedded
stories260K model with its heads and on pythia-mini with heads; plus the per-step decoding-logic
time of the dynamic proposal (k = 50, n = 2, 3) next to a pythia-70m-shaped forward.

Every method decodes the same prompts; each repetition runs the methods interleaved and the best
repetition counts (the machine may be shared). Prints a table and writes JSON.

    python scripts/bench_decode.py --out bench_decode.json [--pythia-heads DIR] [--device cuda --dtype bfloat16]
    python scripts/bench_decode.py --shapes 160m 410m --out bench_shapes.json   # step cost only
    python scripts/bench_decode.py --shapes 410m --shape-dtypes float32 bfloat16 --out bench_shapes.json

``--batch-sizes 1 2 4 8 16``: only the batch bench: for each batch size B, B prompts of
different lengths decoded together by transformers' batched greedy ``generate`` (left-padded),
our batched ``ar``, ``speculative`` greedy and sampled, ``typical``, ``dynamic`` (``--batch-eps``) and
greedy static / dynamic trees (``--batch-tree-nodes``):
tokens/s, tokens per forward (batching must not lower it), whether every row equals its B = 1
output, and peak memory; on the embedded default and on pythia-mini (``--heads DIR``: trained heads).

    python scripts/bench_decode.py --batch-sizes 1 2 4 8 16 --out bench_batch.json [--heads DIR] [--device cuda]

``--shapes``: only the step-cost bench on random-weight GPT-NeoX models of pythia-160m / 410m
shapes (no download) with 3 random replicated heads: per mode model and logic ms per step,
tokens per forward, ms per token and the step-cost ratio over an ``ar`` step (the goal:
<= 1.2x for dynamic and speculative on 410m).

Our rows run with ``generate(profile=True)``: on an accelerator the model / logic split then
synchronises the device at every clock reading. The record names the device, dtype, threads and
the load average at the start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.pipeline.model.backbone import Backbone, BackboneConfig
from multitoken.kernels.cpu_linear import CPU_LINEARS, ROWS
from multitoken.embedded import EMBEDDED_HEADS, EMBEDDED_STATS
from multitoken.embedded import DEFAULT_BASE
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.pipeline.runtime.unembed_plan import plan_for

from bench_batches import bench_batches, print_batches
from bench_common import FIXTURES, PROMPTS, best_of, device_name, load, open_table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_decode.json")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (32 with --shapes)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (the fastest kept), after one untimed warm-up run of each method")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the same for every method)")
    p.add_argument("--device", default="cpu", help="where the models run: cpu, cuda, cuda:1 (the logic timing stays on the CPU)")
    p.add_argument("--dtype", default="float32", help="weights dtype of the models (float32, bfloat16, float16)")
    p.add_argument("--cpu-linear", default=ROWS, choices=CPU_LINEARS,
                   help="CPU linears of every row, transformers' included (scripts/bench_linear.py compares them)")
    p.add_argument("--embedded-heads", default=str(EMBEDDED_HEADS))
    p.add_argument("--embedded-stats", default=str(EMBEDDED_STATS))
    p.add_argument("--pythia-mini", default=str(FIXTURES / "pythia-mini"))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=None, help="only the batch bench at these batch sizes")
    p.add_argument("--batch-eps", type=float, default=0.5, help="eps_b of the batch bench's dynamic row (the same-quality point)")
    p.add_argument("--batch-tree-nodes", type=int, default=16,
                   help="node budget of the batch bench's greedy static / dynamic tree rows (0: no tree rows)")
    p.add_argument("--pythia-heads", "--heads", dest="pythia_heads", default=None, help="heads trained for pythia-mini by scripts/build_heads.py (default: untrained copies)")
    p.add_argument("--pythia-stats", default=None, help="stats dir with the pythia tokenizer (dynamic masking on pythia-mini)")
    p.add_argument("--logic-stats", default=None,
                   help="a big stats dir (any tokenizer) for a second logic timing, e.g. the 18.4M-trigram table "
                        "scripts/bench_stats.py --work DIR leaves in DIR/merged")
    p.add_argument("--temperature", type=float, default=0.7, help="sampled rows (DynaMo: 0.7)")
    p.add_argument("--top-k", type=int, default=50, help="sampled rows (DynaMo: 50)")
    p.add_argument("--repetition-penalty", type=float, default=1.1, help="sampled rows (DynaMo: 1.1; hf_sample: transformers' logit form)")
    p.add_argument("--logic-new-tokens", type=int, default=120, help="tokens per prompt of the recorded dynamic decoding (steps of the logic timing)")
    p.add_argument("--logic-reps", type=int, default=5, help="passes over the recorded steps per timing")
    p.add_argument("--logic-only", action="store_true", help="only the per-step decoding-logic timing (seconds, not minutes)")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None,
                   help="only the step-cost bench on random-weight models of these pythia shapes")
    p.add_argument("--shape-prompt", type=int, default=64, help="random prompt tokens (--shapes)")
    p.add_argument("--shape-dtypes", nargs="+", default=None, choices=("float32", "bfloat16", "float16"),
                   help="--shapes in each of these dtypes, one after the other (default: --dtype); on CPUs with "
                        "AVX512-BF16, bfloat16 multi-row matmuls cost about one row's (oneDNN), float32 ones 2-3x (MKL)")
    p.add_argument("--shape-stats", default=None, help="a stats dir over a 50304-token vocabulary (the pythia "
                   "tokenizer) for a masked dynamic row (--shapes; default: unmasked dynamic only)")
    args = p.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 32 if args.shapes else 128
    return args


def hf_runner(model, prompt_lookup: bool, max_new: int, sample: dict | None = None):
    """transformers' ``generate``: greedy (optionally prompt lookup), or sampling with ``sample``
    = {temperature, top_k, repetition_penalty} (seeded through torch's global generator)."""
    bb = model.backbone
    extra = {"prompt_lookup_num_tokens": 10} if prompt_lookup else {}
    if sample:
        extra.update(top_p=1.0, **sample)

    def run(ids):
        ids = ids.to(bb.device)
        if sample:
            torch.manual_seed(0)
        out = bb.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                do_sample=bool(sample), pad_token_id=bb.tokenizer.eos_token_id, **extra)
        return out[0, ids.shape[1]:].tolist(), None
    return run


def our_runner(model, cfg: DecodeConfig, table):
    def run(ids):
        res = generate(model, ids, cfg, table=table, profile=True)  # exact model / logic split on any device
        return res.token_ids, res.trace
    return run


def over_prompts(run, ids) -> dict:
    """One method over every prompt: its outputs, traces and token count."""
    outputs, traces = [], []
    for x in ids:
        out, trace = run(x)
        outputs.append(out)
        traces.append(trace)
    return {"outputs": outputs, "traces": traces, "tokens": sum(map(len, outputs))}


def bench_model(name, model, heads_label, table, prompts, args) -> dict:
    tok = model.backbone.tokenizer
    ids = [tok(p, return_tensors="pt").input_ids for p in prompts]
    n = model.n_future
    base = dict(max_new_tokens=args.max_new_tokens, n=n)
    sample = dict(temperature=args.temperature, top_k=args.top_k, repetition_penalty=args.repetition_penalty)
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
            "unembed_plan_ms": unembed_plan_ms(model),
            "hf_sample_penalty": "transformers' logit form (logit / penalty if > 0, else x penalty, before temperature and top-k)",
            "methods": rows}


def pythia70m_shaped() -> MultiTokenModel:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=50304, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                        intermediate_size=2048, max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True)
    model = GPTNeoXForCausalLM(cfg).eval()
    bb = Backbone(model, None, "pythia-70m-shaped (random)", BackboneConfig(base="random"))
    return MultiTokenModel.attach(bb, {"head_type": "medusa", "n_future": 3})


SHAPES = {"160m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12),
          "410m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16)}


def pythia_shaped(shape: str, device: str, dtype: str, cpu_linear: str = ROWS) -> MultiTokenModel:
    """A random-weight GPT-NeoX of a pythia shape (config only, no download) with 3 random
    replicated heads: cost, not quality."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    dims = SHAPES[shape]
    cfg = GPTNeoXConfig(vocab_size=50304, intermediate_size=4 * dims["hidden_size"], max_position_embeddings=2048,
                        rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False, **dims)
    bb = Backbone(GPTNeoXForCausalLM(cfg).eval(), None, f"pythia-{shape}-shaped (random)",
                  BackboneConfig(base="random", cpu_linear=cpu_linear))
    model = MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "random"})
    return model.to(device=device, dtype=getattr(torch, dtype)).eval()  # packed by the first decode


def unembed_plan_ms(model) -> dict:
    """The unembedding plan this process measured for ``model`` (ms per call, per row count and
    form; empty on an accelerator: one call, nothing measured)."""
    bb = model.backbone
    probe = torch.empty(1, bb.hidden_size, dtype=bb.unembedding.weight.dtype, device=bb.device)
    return plan_for(bb.unembedding, probe).as_dict()


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
    sample = dict(temperature=args.temperature, top_k=args.top_k, repetition_penalty=args.repetition_penalty)
    base = dict(max_new_tokens=args.max_new_tokens, n=3, stop_at_eos=False)
    out = {}
    for shape, dtype in [(shape, dtype) for shape in args.shapes for dtype in args.shape_dtypes or [args.dtype]]:
        model = pythia_shaped(shape, args.device, dtype, args.cpu_linear)
        prompt = torch.randint(0, 50304, (1, args.shape_prompt), generator=torch.Generator().manual_seed(1))
        table = None
        if args.shape_stats:
            from multitoken.stats.table import CooccurrenceTable

            table = CooccurrenceTable(args.shape_stats)
        modes = {"ar": DecodeConfig(mode="ar", greedy=True, max_new_tokens=args.max_new_tokens, stop_at_eos=False),
                 "speculative_greedy": DecodeConfig(mode="speculative", greedy=True, **base),
                 # eps_b 0: the full order-3 grid every step (3 tokens per forward), the costliest logic
                 "dynamic_eps0": DecodeConfig(mode="dynamic", eps_b=0.0, **base, **sample)}
        tables = {label: None for label in modes}
        if table is not None:
            modes["dynamic_eps0_masked"], tables["dynamic_eps0_masked"] = modes["dynamic_eps0"], table
        for label, cfg in modes.items():  # warm-up: allocations, and the unembedding plan measures its row counts
            generate(model, prompt, replace(cfg, max_new_tokens=4), table=tables[label])
        best: dict[str, tuple[float, list]] = {}
        for _ in range(args.reps):
            for label, cfg in modes.items():
                trace = generate(model, prompt, cfg, table=tables[label], profile=True).trace
                per_step = (trace.wall_s - trace.prefill_s) / max(trace.forward_passes - 1, 1)
                if label not in best or per_step < best[label][0]:
                    best[label] = (per_step, [trace])
        rows = {label: step_row(traces) for label, (_, traces) in best.items()}
        for row in rows.values():
            row["step_cost_vs_ar"] = row["ms_per_step"] / rows["ar"]["ms_per_step"]
            row["model_cost_vs_ar"] = row["model_ms_per_step"] / rows["ar"]["model_ms_per_step"]
        out[shape if dtype == "float32" else f"{shape}-{dtype}"] = {"model": model.backbone.name, "dtype": dtype,
                      "unembed_plan_ms": unembed_plan_ms(model),
                      "prompt_tokens": args.shape_prompt, "stats": args.shape_stats, "sampling": sample, "modes": rows}
        del model
    return out


def print_shapes(shapes: dict) -> None:
    for shape, r in shapes.items():
        print(f"\npythia-{shape}-shaped (random weights, 3 replicated heads, {r['dtype']}), prompt {r['prompt_tokens']} tokens")
        print(f"{'mode':20s} {'model ms/step':>13s} {'logic ms/step':>13s} {'tok/fwd':>8s} {'ms/token':>9s} "
              f"{'step x ar':>9s} {'model x ar':>10s}  rows/unembed call")
        for label, m in r["modes"].items():
            print(f"{label:20s} {m['model_ms_per_step']:13.3f} {m['logic_ms_per_step']:13.3f} {m['tokens_per_forward']:8.2f} "
                  f"{m['ms_per_token']:9.3f} {m['step_cost_vs_ar']:9.3f} {m['model_cost_vs_ar']:10.3f}  {m['unembed_rows']}")


def median_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def bench_logic(args) -> dict:
    """Per-step DynaMo logic split into stages (top-k, lookup, grid + threshold, blur + Otsu,
    penalty + sample) for the dense, sparse-numpy and sparse-numba kernels at k = 50, n = 2 and 3:
    on steps recorded from the embedded model with its heads and stats, and (``--logic-stats``)
    on a big table with head distributions leaning to its frequent tokens; next to one forward of
    a pythia-70m-shaped model for scale."""
    from logic_stages import bench_stages, recorded_steps, synthetic_steps

    model = pythia70m_shaped()
    vocab = model.backbone.vocab_size
    caches = model.new_caches()
    model.step(torch.randint(0, vocab, (1, 128)), caches)  # a 128-token context in the cache
    nxt = torch.tensor([[11]])

    def forward_one():
        out = model.step(nxt, caches)
        out.head_log_probs(0, 0)
        caches.keep(128, [[]])

    out = {"forward_ms_pythia70m_shape_1_token_ctx128": round(median_ms(forward_one, 30), 3),
           "targets_ms": {"embedded_n3_dynamic_propose": 0.3, "big_table_n3_dynamic_propose": 1.5}}
    emb, _ = load(str(DEFAULT_BASE), args.embedded_heads)
    table = open_table(args.embedded_stats, emb.backbone.tokenizer)
    prompts = [emb.backbone.tokenizer.encode(p) for p in PROMPTS["stories"]]
    steps = recorded_steps(emb, table, prompts, args.logic_new_tokens)  # [3 heads' logps], seen
    out["embedded"] = bench_stages({2: steps, 3: steps}, table, args.logic_reps)
    out["embedded"]["steps"] = len(steps)
    if args.logic_stats:
        from multitoken.stats.table import CooccurrenceTable

        big = CooccurrenceTable(args.logic_stats)  # timing only: any tokenizer will do
        count = max(len(steps), 50)
        out["big_table"] = bench_stages({n: synthetic_steps(big, n, count) for n in (2, 3)}, big, args.logic_reps)
        out["big_table"]["steps"] = count
    return out


def print_logic(logic: dict) -> None:
    print(f"forward of a pythia-70m-shaped model: {logic['forward_ms_pythia70m_shape_1_token_ctx128']} ms")
    for key in ("embedded", "big_table"):
        if key not in logic:
            continue
        r = logic[key]
        print(f"\n{key}: {r['stats']} ({r['steps']} steps), numba prepare {r.get('numba_prepare_s')} s, machine {r['machine']}")
        print(f"{'case':22s} {'topk':>7s} {'lookup':>7s} {'grid+thr':>8s} {'blur+otsu':>9s} {'pen+samp':>8s} {'sum':>7s} "
              f"{'propose':>8s} {'seen':>6s} {'live':>5s}  (ms, medians)")
        for case, t in r.items():
            if isinstance(t, dict) and "topk" in t:
                print(f"{case:22s} {t['topk']:7.3f} {t['lookup']:7.3f} {t['grid_threshold']:8.3f} {t['blur_otsu']:9.3f} "
                      f"{t['penalty_sample']:8.3f} {t['stages_sum']:7.3f} {t['dynamic_propose']:8.3f} "
                      f"{t['seen_cells_median']:6d} {t['live_cells_median']:5d}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    record = {"machine": {"platform": platform.platform(), "threads": args.threads, "cpu_count": os.cpu_count(),
                          "device": args.device, "device_name": device_name(args.device), "dtype": args.dtype,
                          "cpu_linear": args.cpu_linear,
                          "torch": torch.__version__, "loadavg_start": list(os.getloadavg())},
              "max_new_tokens": args.max_new_tokens, "reps": args.reps, "warm_up_runs": 1}
    # one-part runs: the batch bench, the bigger shapes, or the DynaMo logic alone
    for key, wanted, bench, show in (("batches", args.batch_sizes, bench_batches, print_batches),
                                     ("shapes", args.shapes, bench_shapes, print_shapes),
                                     ("logic", args.logic_only, bench_logic, print_logic)):
        if wanted:
            record[key] = bench(args)
            return _finish(record, args.out, lambda: show(record[key]))
    emb, emb_heads = load(str(DEFAULT_BASE), args.embedded_heads, args.device, args.dtype, args.cpu_linear)
    record["embedded"] = bench_model("stories260K (embedded)", emb, emb_heads, open_table(args.embedded_stats, emb.backbone.tokenizer),
                                     PROMPTS["stories"], args)
    pm, pm_heads = load(args.pythia_mini, args.pythia_heads, args.device, args.dtype, args.cpu_linear)
    record["pythia_mini"] = bench_model("pythia-mini", pm, pm_heads, open_table(args.pythia_stats, pm.backbone.tokenizer),
                                        PROMPTS["pile"], args)
    record["logic"] = bench_logic(args)
    return _finish(record, args.out, lambda: print_table(record))


def _finish(record: dict, out: str, show) -> dict:
    """The load at the end recorded, the JSON written, the table printed."""
    record["machine"]["loadavg_end"] = list(os.getloadavg())
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    show()
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
    print_logic(record["logic"])
    m = record["machine"]
    print(f"device {m['device']} ({m['device_name']}), dtype {m['dtype']}, {m['threads']} torch threads")
    print("load average start/end:", m["loadavg_start"], m["loadavg_end"])


if __name__ == "__main__":
    main()
