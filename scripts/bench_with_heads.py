"""transformers' own greedy ``generate`` against ``custom_generate=with_heads(HEADS)``, on SmolLM2.

One model object, loaded as a user loads it (``AutoModelForCausalLM.from_pretrained`` of the
checkpoint ``multitoken fetch smollm2`` wrote; torch's stock linears): "plain" is
``model.generate(do_sample=False)`` on it, each with_heads row the same call with
``custom_generate=with_heads(HEADS, tree=T)`` (its defaults otherwise: our CPU linears on a
packed copy, the shipped heads' drafts). Same prompts (DynaMo's Table 7) and settings; every
output must be plain's token for token, or the script exits non-zero after saving its record.

Timing: CPU seconds (one torch thread). Each method's first call is timed apart (with_heads:
the copy and the packing, which the later with_heads rows share, the heads, and a tree's step
times where the cache lacks them), then per
prompt ``best_of`` interleaves the methods ``--reps`` times and keeps each one's fastest. The
speed-up is paired: per prompt, plain's CPU time over the method's, summarised by the geometric
mean (and the lowest and highest); tokens/s sum every prompt. ``record["table"]`` is the table
for docs/benchmarks/results/smollm2.json (machine, date, command filled from the record).

    python scripts/bench_with_heads.py --out with_heads.json                        # figures: a quiet machine
    python scripts/bench_with_heads.py --num-prompts 1 --max-new-tokens 8 --reps 1  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import math
import time

import torch

from multitoken.embedded import SMOLLM2_CONDITIONED
from multitoken.kernels.cpu_linear import CPU_LINEARS, ROWS
from multitoken.pipeline.eval.benchmark import Bench, add_out, best_of
from multitoken.pipeline.eval.sweep import TABLE7_PROMPTS
from multitoken.pipeline.integrations.hf_generate import with_heads
from multitoken.pipeline.sources.fetch import fetch

PLAIN = "plain generate"
TABLE_ID = "smollm2-with-heads"


def arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, None)
    p.add_argument("--base", default=None, help="checkpoint dir (default: SmolLM2-135M-Instruct as `multitoken fetch smollm2` keeps it)")
    p.add_argument("--heads", default=f"embedded:{SMOLLM2_CONDITIONED.name}", help="heads dir or embedded:NAME (default: SmolLM2's shipped drafting heads)")
    p.add_argument("--trees", nargs="+", default=["chain", "static"], help="with_heads(tree=...) rows, one per value")
    p.add_argument("--cpu-linear", default=ROWS, choices=CPU_LINEARS, help="with_heads(cpu_linear=...); plain keeps torch's linears")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=len(TABLE7_PROMPTS), help="the first N of DynaMo's Table 7 prompts")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per prompt (the fastest kept), after the first calls")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    return p.parse_args(argv)


def timed(call) -> dict:
    """``call()``'s new token ids and its CPU and wall seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = call()
    return {"out": out, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}


def methods(model, pad: int, args) -> dict:
    """Label -> run(ids) -> (new token ids, tokens per forward or None), on ``model``."""
    def plain(ids, **extra):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             do_sample=False, pad_token_id=pad, **extra)
        return out[0, ids.shape[1]:].tolist()

    def ours(tree):
        def run(ids):
            method = with_heads(args.heads, tree=tree, cpu_linear=args.cpu_linear)  # as a user writes it: per call
            return plain(ids, custom_generate=method), method.traces[0].tokens_per_forward
        return run

    return {PLAIN: lambda ids: (plain(ids), None), **{f"with_heads tree={t}": ours(t) for t in args.trees}}


def measure(runs: dict, prompts: list, reps: int) -> tuple[dict, dict]:
    """(first calls, per prompt per method the fastest of ``reps``): CPU s, tokens, output, tokens/forward."""
    def as_result(label, ids):
        def run():
            got = timed(lambda: runs[label](ids))
            (out, tpf), cpu = got["out"], got["cpu_s"]
            return {"out": out, "tokens": len(out), "cpu_s": cpu, "tokens_per_forward": tpf}
        return run

    first = {label: timed(lambda: runs[label](prompts[0])) for label in runs}
    first = {label: {"cpu_s": round(r["cpu_s"], 3), "wall_s": round(r["wall_s"], 3)} for label, r in first.items()}
    per_prompt = {label: [] for label in runs}
    for ids in prompts:
        best = best_of({label: as_result(label, ids) for label in runs}, reps, warm_up=False, score=lambda r: r["cpu_s"])
        for label, r in best.items():
            per_prompt[label].append(r)
    return first, per_prompt


def summarise(per_prompt: dict) -> dict:
    """Per method: tokens/s over every prompt, the paired ratios to plain, tokens/forward, equality."""
    plain = per_prompt[PLAIN]
    out = {}
    for label, rows in per_prompt.items():
        ratios = [p["cpu_s"] / r["cpu_s"] for p, r in zip(plain, rows)]
        tpf = [r["tokens_per_forward"] for r in rows if r["tokens_per_forward"] is not None]
        out[label] = {"tokens": sum(r["tokens"] for r in rows), "cpu_s": round(sum(r["cpu_s"] for r in rows), 3),
                      "tokens_per_s": round(sum(r["tokens"] for r in rows) / sum(r["cpu_s"] for r in rows), 2),
                      "ratio_geomean": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3),
                      "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
                      "tokens_per_forward": round(sum(tpf) / len(tpf), 3) if tpf else None,
                      "equal_to_plain": [r["out"] for r in rows] == [p["out"] for p in plain]}
    return out


def table(record: dict, summary: dict, first: dict) -> dict:
    """The results-file table (scripts/benchmark_tables.py) of ``record``."""
    m = record["machine"]
    threads = f"{m['torch_threads']} torch thread" + ("s" if m["torch_threads"] != 1 else "")
    s = record["settings"]
    rows = [[label, "" if r["tokens_per_forward"] is None else f"{r['tokens_per_forward']:.2f}", f"{r['tokens_per_s']:.1f}",
             f"**{r['ratio_geomean']:.2f}** ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})", f"{first[label]['cpu_s']:.2f}"]
            for label, r in summary.items()]
    return {"id": TABLE_ID, "machine": f"{m['cores']}-core {m['cpu']}, {threads}", "date": datetime.date.today().isoformat(),
            "command": record["command"], "source": "the run's --out record",
            "columns": ["method", "tokens / forward", "tokens / s (CPU)", "x plain generate, per prompt (lowest-highest)",
                        "first call, CPU s"],
            "rows": rows,
            "note": f"Greedy, {s['max_new_tokens']} new tokens, the first {s['num_prompts']} of DynaMo's Table 7 prompts, best of "
                    f"{s['reps']} per prompt; heads {s['heads']}, cpu_linear={s['cpu_linear']}; the first with_heads row's first "
                    "call packs the linears the later rows share; every row identical to plain generate's output."}


def main(argv=None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = arguments(argv)
    torch.set_num_threads(args.threads)  # before the record, which names the threads
    bench = Bench("with_heads", args, base=args.base or "fetched:SmolLM2-135M-Instruct", heads=args.heads,
                  trees=args.trees, cpu_linear=args.cpu_linear, max_new_tokens=args.max_new_tokens,
                  num_prompts=args.num_prompts, reps=args.reps, threads=args.threads)
    base = args.base or str(fetch("smollm2"))
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=False).eval()
    prompts = [tok(p, return_tensors="pt").input_ids for p in TABLE7_PROMPTS[: args.num_prompts]]
    first, per_prompt = measure(methods(model, tok.eos_token_id, args), prompts, args.reps)
    summary = summarise(per_prompt)
    bench.record.update(first_call=first, methods=summary, table=table(bench.record, summary, first),
                 outputs={label: [r["out"] for r in rows] for label, rows in per_prompt.items()})
    for label, r in summary.items():
        print(f"{label:28s} {r['tokens_per_s']:7.1f} tok/s  x{r['ratio_geomean']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
              f"  tokens/forward {r['tokens_per_forward'] or '-'}  first call {first[label]['cpu_s']:.2f} s"
              f"  equal {r['equal_to_plain']}")
    record = bench.save()
    differ = [label for label, r in summary.items() if not r["equal_to_plain"]]
    if differ:
        raise SystemExit(f"error: {', '.join(differ)} differ from plain generate's greedy output (record kept in --out)")
    return record


if __name__ == "__main__":
    main()
