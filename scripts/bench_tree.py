"""Tree verification benchmark: greedy tokens per forward and tokens/s of the chain
against static and dynamic candidate trees at node budgets 4 / 8 / 16 / 32 / 64 (and ``auto``),
beside transformers' greedy and prompt-lookup ``generate``; on the embedded stories260K model
with its shipped heads (bench_decode.py's story prompts) and, with ``--pythia-heads DIR``, on
pythia-mini with trained heads (its pile prompts); with ``--smollm2``, on the real SmolLM2-135M
with its shipped token-conditioned heads (the best greedy drafts; ``--smollm2-heads`` for others) and
stats (DynaMo's Table 7 prompts). Every row must reproduce transformers'
greedy output (``identical``). With stats (the embedded model's), ``dynamic_joint_N`` rows rank
the dynamic tree's paths by DynaMo's co-occurrence-masked joint (the joint drafter's scores).
Layer heads draft over their draft vocabulary where the heads dir records one (draft_vocab.json);
``--whole-vocab-rows`` adds two rows with drafts over the whole vocabulary, for comparison.
``--lookup K`` adds the chain and the trees with a prompt lookup branch (``chain+lookup``,
``static_N+lookup``, ``dynamic_N+lookup``), beside transformers' own prompt lookup row;
``--sampled`` adds sampled rows (DynaMo's settings; lossless speculative sampling against our
``ar`` sampling and transformers'); ``--rows`` keeps only the methods named.

Each repetition runs the methods interleaved and the best repetition counts (the machine may be
shared); the untimed warm-up run of each method decodes the first prompt only (what it warms --
kernels, caches, ``auto``'s timing of the verify step -- does not depend on how many prompts
follow). Tokens per forward do not depend on the load, ``--tpf-only`` measures only them (one
repetition, no transformers rows). transformers' rows count their forward passes too (a hook
on the model). ``x ar`` is every greedy row against our ``ar`` greedy row, every sampled row
against ``ar_sample``. A line on stderr follows every run; ``--plot PNG`` draws the speeds.

    python scripts/bench_tree.py --out bench_tree.json [--pythia-heads DIR] [--reps 5] [--device cuda]
    python scripts/bench_tree.py --tpf-only --max-new-tokens 32     # a smoke run / acceptance only
    python scripts/bench_tree.py --smollm2 --no-embedded --num-prompts 2 --rows chain --plot trees.png
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.embedded import DEFAULT_BASE, EMBEDDED_HEADS, EMBEDDED_STATS, SMOLLM2, SMOLLM2_CONDITIONED, SMOLLM2_STATS
from multitoken.pipeline.eval.benchmark import (FIXTURES, PROMPTS, Bench, add_out, best_of, hf_runner, load, open_table,
                                                our_runner, over_prompts)
from multitoken.pipeline.eval.plotting import plot_speeds
from multitoken.pipeline.eval.sweep import TABLE7_PROMPTS
from multitoken.pipeline.sources.fetch import fetch

BUDGETS = (4, 8, 16, 32, 64)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "bench_tree.json")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (the fastest kept), after one untimed warm-up run of each method")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    p.add_argument("--embedded-heads", default=str(EMBEDDED_HEADS))
    p.add_argument("--embedded-stats", default=str(EMBEDDED_STATS), help="the chain_joint row's co-occurrence stats")
    p.add_argument("--pythia-mini", default=str(FIXTURES / "pythia-mini"))
    p.add_argument("--pythia-heads", default=None, help="trained pythia-mini heads (scripts/build_heads.py); without it pythia-mini is skipped")
    p.add_argument("--tpf-only", action="store_true", help="tokens per forward only: one repetition, no transformers rows")
    p.add_argument("--smollm2", action="store_true", help="also the real model, SmolLM2-135M-Instruct (`multitoken fetch smollm2`), "
                   "with its shipped heads and stats, on DynaMo's Table 7 prompts (none in the heads' training text)")
    p.add_argument("--smollm2-heads", default=str(SMOLLM2_CONDITIONED),
                   help="heads dir for the SmolLM2 rows (default: the shipped token-conditioned heads)")
    p.add_argument("--whole-vocab-rows", action="store_true",
                   help="also the joint chain and the first budget's dynamic tree with drafts over the whole vocabulary "
                        "(--draft-vocab 0), beside the same rows with the heads' draft vocabulary (draft_vocab.json)")
    p.add_argument("--lookup", type=int, default=0,
                   help="also the greedy trees with a prompt lookup branch of up to K tokens (--lookup K): rows chain+lookup "
                        "(the heads' chain as a 2-node static tree), static_B+lookup and dynamic_B+lookup (with --sampled "
                        "the sampled rows' +lookup too)")
    p.add_argument("--sampled", action="store_true",
                   help="also sampled rows at DynaMo's settings (temperature 0.7, top-k 50, repetition penalty 1.1): "
                        "transformers' sampling (hf_sample; its penalty in logit form), our ar_sample, and lossless "
                        "sampled speculative decoding: sampled_chain, sampled_dynamic_B (with --lookup also their +lookup "
                        "rows); each against ar_sample (x ar), no identity check")
    p.add_argument("--rows", nargs="+", default=None,
                   help="only these methods (labels as printed, e.g. chain chain+lookup dynamic_auto); hf_greedy always runs: "
                        "the reference every row is compared with")
    p.add_argument("--first-kernel-rows", nargs="+", default=None,
                   help="with several --cpu-linear: only these methods on the first choice (e.g. hf_greedy ar: "
                        "the later kernels' x HF against it at the cost of two methods)")
    p.add_argument("--num-prompts", type=int, default=None, help="only each model's first N prompts (default: all)")
    p.add_argument("--plot", default=None, help="PNG of every row's tokens/s (and tokens per forward, x HF)")
    p.add_argument("--quiet", action="store_true", help="no progress line after each run")
    p.add_argument("--no-embedded", action="store_true", help="skip the embedded stories260K rows")
    p.add_argument("--cpu-linear", nargs="+", default=["rows"], choices=("rows", "rows-f32", "packed", "stock"),
                   help="the kernels of every row, transformers' included (the same model object); several: "
                        "the SmolLM2 rows once per choice, each model loaded anew, x HF against the first choice's")
    return p.parse_args(argv)


def methods(model, args, table=None) -> dict:
    cfg = dict(mode="speculative", greedy=True, max_new_tokens=args.max_new_tokens)
    rows = {}
    if not args.tpf_only:
        rows["hf_greedy"] = counted(hf_runner(model, False, args.max_new_tokens), model.backbone.model)
        rows["hf_prompt_lookup"] = counted(hf_runner(model, True, args.max_new_tokens), model.backbone.model)
        rows["ar"] = our_runner(model, DecodeConfig(mode="ar", greedy=True, max_new_tokens=args.max_new_tokens), None)
    rows["chain"] = our_runner(model, DecodeConfig(**cfg, drafter="independent"), None)
    if table is not None:  # bench_decode.py's speculative_greedy row: drafts from the co-occurrence-masked joint
        rows["chain_joint"] = our_runner(model, DecodeConfig(**cfg), table)
    for tree in ("static", "dynamic"):
        for b in args.budgets:
            rows[f"{tree}_{b}"] = our_runner(model, DecodeConfig(**cfg, tree=tree, tree_nodes=str(b), drafter="independent"), None)
        if not args.tpf_only:
            rows[f"{tree}_auto"] = our_runner(model, DecodeConfig(**cfg, tree=tree, tree_nodes="auto", drafter="independent"), None)
    if table is not None:  # dynamic trees ranked by the co-occurrence-masked joint (the joint drafter's scores)
        for b in args.budgets:
            rows[f"dynamic_joint_{b}"] = our_runner(model, DecodeConfig(**cfg, tree="dynamic", tree_nodes=str(b)), table)
    if args.lookup:  # the heads' tree plus one branch copied from the context (decoding/trees.py)
        look = dict(cfg, drafter="independent", lookup=args.lookup)
        rows["chain+lookup"] = our_runner(model, DecodeConfig(**look, tree="static", tree_nodes=str(model.n_future - 1)), None)
        for tree in ("static", "dynamic"):
            for b in args.budgets:
                rows[f"{tree}_{b}+lookup"] = our_runner(model, DecodeConfig(**look, tree=tree, tree_nodes=str(b)), None)
    if args.sampled:
        rows.update(sampled_methods(model, args))
    if args.whole_vocab_rows:
        chain = dict(drafter="auto" if table is not None else "independent")
        rows["chain_whole_vocab"] = our_runner(model, DecodeConfig(**cfg, **chain, draft_vocab=0), table)
        rows[f"dynamic_{args.budgets[0]}_whole_vocab"] = our_runner(
            model, DecodeConfig(**cfg, tree="dynamic", tree_nodes=str(args.budgets[0]), drafter="independent", draft_vocab=0), None)
    return rows


SAMPLE = dict(temperature=0.7, top_k=50, repetition_penalty=1.1)  # DynaMo's sampling settings


def sampled(label: str) -> bool:
    return label in ("hf_sample", "ar_sample") or label.startswith("sampled_")


def sampled_methods(model, args) -> dict:
    """Sampled rows: transformers' and our one-token sampling, the sampled chain and dynamic
    trees (lossless rejection sampling), with a lookup branch where --lookup is given."""
    new = args.max_new_tokens
    rows = {} if args.tpf_only else {"hf_sample": counted(hf_runner(model, False, new, SAMPLE), model.backbone.model),
                                     "ar_sample": our_runner(model, DecodeConfig(mode="ar", max_new_tokens=new, **SAMPLE), None)}
    spec = dict(mode="speculative", max_new_tokens=new, drafter="independent", **SAMPLE)
    shapes = {"sampled_chain": {}, **{f"sampled_dynamic_{b}": dict(tree="dynamic", tree_nodes=str(b)) for b in args.budgets}}
    for label, shape in shapes.items():
        rows[label] = our_runner(model, DecodeConfig(**spec, **shape), None)
        if args.lookup:
            rows[f"{label}+lookup"] = our_runner(model, DecodeConfig(**spec, **shape, lookup=args.lookup), None)
    return rows


def counted(run, module):
    """transformers' runner with a trace of its forward passes (a hook counts ``module``'s calls;
    one per generated token for greedy, one per verification for prompt lookup)."""
    def wrapped(ids):
        calls = []
        hook = module.register_forward_hook(lambda *_: calls.append(1))
        try:
            out, _ = run(ids)
        finally:
            hook.remove()
        return out, SimpleNamespace(forward_passes=len(calls), tree_nodes=0, tree_accuracies="")
    return wrapped


def timed_runs(name: str, runners: dict, ids: list, warm_up: bool, log) -> dict:
    """best_of's runs: each method's first call (its warm-up when ``warm_up``) decodes the first
    prompt only, every later call all of ``ids``; ``log`` gets a line after each call."""
    started, calls = time.perf_counter(), dict.fromkeys(runners, 0)

    def one(i: int, label: str, run):
        def go() -> dict:
            warm = warm_up and calls[label] == 0
            calls[label] += 1
            t, cpu = time.perf_counter(), time.process_time()
            result = over_prompts(run, ids[:1] if warm else ids)
            took, cpu = time.perf_counter() - t, time.process_time() - cpu  # CPU well below wall: a busy machine
            what = "warm-up, first prompt" if warm else f"{result['tokens']} tokens, {result['tokens'] / took:.1f} tok/s"
            log(f"{name}: {label} ({i}/{len(runners)}, {what}) {took:.1f} s ({cpu:.1f} s CPU); "
                f"{time.perf_counter() - started:.0f} s so far")
            return result
        return go
    return {label: one(i, label, run) for i, (label, run) in enumerate(runners.items(), 1)}


def bench(name, model, heads_label, prompts, args, table=None, only=None, log=lambda msg: None) -> dict:
    """Every method's best run on ``prompts`` (``only``: those methods, hf_greedy always), rows of
    tokens, tokens/s, tokens per forward, x HF greedy, x ar and whether the text is transformers'."""
    tok = model.backbone.tokenizer
    ids = [tok(p, return_tensors="pt").input_ids for p in prompts]
    runners = methods(model, args, table)
    if only:
        runners = {k: v for k, v in runners.items() if k in only or k == "hf_greedy"}
    warm = not args.tpf_only  # the warm-up run of each method (auto's one-off timing of the verify step included) is off the clock
    best = best_of(timed_runs(name, runners, ids, warm, log), 1 if args.tpf_only else args.reps, warm_up=warm)
    # greedy rows all give the base's argmax text: transformers' where it ran, else the first greedy row's
    greedy = [label for label in best if not sampled(label)]
    reference = best["hf_greedy" if "hf_greedy" in best else greedy[0]]["outputs"] if greedy else None
    rows = {}
    for label, r in best.items():
        tokens = sum(len(o) for o in r["outputs"])
        row = {"tokens": tokens, "wall_s": round(r["wall_s"], 4), "tokens_per_s": round(tokens / r["wall_s"], 1),
               "identical": None if sampled(label) else r["outputs"] == reference}
        if r["traces"][0] is not None:
            fw = sum(t.forward_passes for t in r["traces"])
            row.update(forward_passes=fw, tokens_per_forward=round(tokens / fw, 3),
                       tree_nodes=r["traces"][0].tree_nodes, tree_accuracies=r["traces"][0].tree_accuracies)
        rows[label] = row
    if "hf_greedy" in rows:
        for row in rows.values():
            row["speedup_vs_hf_greedy"] = round(row["tokens_per_s"] / rows["hf_greedy"]["tokens_per_s"], 3)
    for label, row in rows.items():  # x ar: greedy rows against our ar greedy, sampled ones against ar_sample
        ar = rows.get("ar_sample" if sampled(label) else "ar")
        if ar is not None:
            row["speedup_vs_ar_sample" if sampled(label) else "speedup_vs_ar"] = round(row["tokens_per_s"] / ar["tokens_per_s"], 3)
    return {"model": name, "heads": heads_label, "n": model.n_future, "prompts": prompts, "methods": rows,
            "_outputs": {label: r["outputs"] for label, r in best.items()}}


def first_kernels(m: dict, other: str | None) -> str:
    """`` / True`` where a row also equals the first kernels' transformers text (--cpu-linear A B)."""
    same = m.get("identical_to_" + other[len("speedup_vs_"):]) if other else None
    return "" if same is None else f" / {same}"


def table_lines(r: dict) -> list[str]:
    """One part of the record as printed: a title and a row per method, every column filled
    (``-`` where a column does not apply: no tree, no identity check for sampled rows)."""
    other = next((k for m in r["methods"].values() for k in m if k.startswith("speedup_vs_hf_greedy_")), None)
    extra = f" {'x HF ' + other.rsplit('_', 1)[1]:>12s}" if other else ""
    lines = [f"{r['model']}  heads: {r['heads']}  (n = {r['n']})",
             f"{'method':26s} {'tok/fwd':>8s} {'tok/s':>8s} {'x HF':>6s}{extra} {'x ar':>6s} {'nodes':>6s} identical"]
    for label, m in r["methods"].items():
        col = f" {m.get(other, float('nan')):12.2f}" if other else ""
        x_ar = m.get("speedup_vs_ar_sample" if sampled(label) else "speedup_vs_ar", float("nan"))
        lines.append(f"{label:26s} {m.get('tokens_per_forward', float('nan')):8.3f} {m['tokens_per_s']:8.1f} "
                     f"{m.get('speedup_vs_hf_greedy', float('nan')):6.2f}{col} {x_ar:6.2f} "
                     f"{m.get('tree_nodes') or '-':>6} {'-' if m['identical'] is None else m['identical']}{first_kernels(m, other)}")
    return lines


def headline(r: dict) -> str:
    """The fastest of our greedy rows against transformers' greedy generate, and whether every
    greedy row gave transformers' text (a row that did not is named, never the fastest)."""
    ours = {k: m for k, m in r["methods"].items() if not sampled(k) and not k.startswith("hf_")}
    if "hf_greedy" not in r["methods"] or not ours:
        return f"{r['model']}: no timed greedy row against transformers"
    wrong = [k for k, m in r["methods"].items() if m["identical"] is False]
    label, m = max(((k, m) for k, m in ours.items() if m["identical"]), key=lambda km: km[1]["tokens_per_s"],
                   default=(None, None))
    other = next((k for k in (m or {}) if k.startswith("speedup_vs_hf_greedy_")), None)
    vs_first = f", x{m[other]:.2f} transformers on {other.rsplit('_', 1)[1]} linears" if other else ""
    best = ("no greedy row gave transformers' text" if m is None else
            f"fastest {label}: {m['tokens_per_s']:.1f} tok/s, {m['tokens_per_forward']:.2f} tokens/forward, "
            f"x{m['speedup_vs_hf_greedy']:.2f} transformers' greedy generate on the same linears{vs_first}")
    same = "every greedy row gave transformers' greedy text" if not wrong else f"NOT transformers' text: {', '.join(wrong)}"
    return f"{r['model']}: {best}; {same}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    run = Bench("tree", args, device=args.device, dtype=args.dtype, cpu_linear=args.cpu_linear,
                  max_new_tokens=args.max_new_tokens, reps=1 if args.tpf_only else args.reps)
    record = run.record
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))

    def prompts(every) -> list[str]:
        return list(every)[:args.num_prompts]  # None: all

    if not args.no_embedded:
        emb, label = load(str(DEFAULT_BASE), args.embedded_heads, args.device, args.dtype, args.cpu_linear[0])
        table = open_table(args.embedded_stats, emb.backbone.tokenizer)
        record["embedded"] = bench("stories260K (embedded)", emb, label, prompts(PROMPTS["stories"]), args, table, args.rows, log)
    if args.smollm2:
        smollm2_parts(record, args, prompts(TABLE7_PROMPTS), log)
    for part in record.values():
        if isinstance(part, dict):
            part.pop("_outputs", None)
    if args.pythia_heads:
        pm, label = load(args.pythia_mini, args.pythia_heads, args.device, args.dtype, args.cpu_linear[0])
        record["pythia_mini"] = bench("pythia-mini", pm, label, prompts(PROMPTS["pile"]), args, only=args.rows, log=log)
    parts = [record[k] for k in ("embedded", "pythia_mini", *[k for k in record if k.startswith("smollm2")]) if k in record]
    if args.plot and not args.tpf_only:
        record["plot"] = str(plot_speeds(parts, args.plot, f"greedy decoding, {args.max_new_tokens} new tokens per prompt"))
    run.save()
    for part in parts:
        print("\n" + "\n".join(table_lines(part)))
    if not args.tpf_only:
        print("\n" + "\n".join(headline(part) for part in parts))
    if args.plot and not args.tpf_only:
        print(f"wrote {args.plot}")
    return record


def smollm2_parts(record: dict, args, prompts: list[str], log) -> None:
    """SmolLM2 once per --cpu-linear choice (the model loaded anew each time); every later
    choice's rows also against the first choice's transformers: speed and text."""
    for kind in args.cpu_linear:
        first = kind == args.cpu_linear[0]
        log(f"loading {SMOLLM2} ({kind} linears)")
        smol, label = load(str(fetch("smollm2")), args.smollm2_heads, args.device, args.dtype, kind)
        table = open_table(str(SMOLLM2_STATS), smol.backbone.tokenizer)
        only = (args.first_kernel_rows or args.rows) if first and len(args.cpu_linear) > 1 else args.rows
        record["smollm2" if first else f"smollm2_{kind}"] = bench(f"{SMOLLM2} ({kind} linears)", smol, label, prompts,
                                                                 args, table, only, log)
        del smol
    first = record.get("smollm2", {}).get("methods", {}).get("hf_greedy")
    first_text = record.get("smollm2", {}).get("_outputs", {}).get("hf_greedy")
    for kind in args.cpu_linear[1:]:
        later = record[f"smollm2_{kind}"]
        for label, row in later["methods"].items():
            if first:
                row[f"speedup_vs_hf_greedy_{args.cpu_linear[0]}"] = round(row["tokens_per_s"] / first["tokens_per_s"], 3)
            if first_text is not None and not sampled(label):
                row[f"identical_to_hf_greedy_{args.cpu_linear[0]}"] = later["_outputs"][label] == first_text


if __name__ == "__main__":
    main()
