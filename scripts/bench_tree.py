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
shared); tokens per forward do not depend on the load, ``--tpf-only`` measures only them (one
repetition, no transformers rows).

    python scripts/bench_tree.py --out bench_tree.json [--pythia-heads DIR] [--reps 5] [--device cuda]
    python scripts/bench_tree.py --tpf-only --max-new-tokens 32     # a smoke run / acceptance only
"""

from __future__ import annotations

import argparse

import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.embedded import DEFAULT_BASE, EMBEDDED_HEADS, EMBEDDED_STATS, SMOLLM2, SMOLLM2_CONDITIONED, SMOLLM2_STATS
from multitoken.pipeline.eval.benchmark import (FIXTURES, PROMPTS, Bench, add_out, best_of, hf_runner, load, open_table,
                                                our_runner, over_prompts)
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
    p.add_argument("--no-embedded", action="store_true", help="skip the embedded stories260K rows")
    p.add_argument("--cpu-linear", nargs="+", default=["rows"], choices=("rows", "rows-f32", "packed", "stock"),
                   help="the kernels of every row, transformers' included (the same model object); several: "
                        "the SmolLM2 rows once per choice, each model loaded anew, x HF against the first choice's")
    return p.parse_args(argv)


def methods(model, args, table=None) -> dict:
    cfg = dict(mode="speculative", greedy=True, max_new_tokens=args.max_new_tokens)
    rows = {}
    if not args.tpf_only:
        rows["hf_greedy"] = hf_runner(model, False, args.max_new_tokens)
        rows["hf_prompt_lookup"] = hf_runner(model, True, args.max_new_tokens)
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
    rows = {} if args.tpf_only else {"hf_sample": hf_runner(model, False, new, SAMPLE),
                                     "ar_sample": our_runner(model, DecodeConfig(mode="ar", max_new_tokens=new, **SAMPLE), None)}
    spec = dict(mode="speculative", max_new_tokens=new, drafter="independent", **SAMPLE)
    shapes = {"sampled_chain": {}, **{f"sampled_dynamic_{b}": dict(tree="dynamic", tree_nodes=str(b)) for b in args.budgets}}
    for label, shape in shapes.items():
        rows[label] = our_runner(model, DecodeConfig(**spec, **shape), None)
        if args.lookup:
            rows[f"{label}+lookup"] = our_runner(model, DecodeConfig(**spec, **shape, lookup=args.lookup), None)
    return rows


def bench(name, model, heads_label, prompts, args, table=None) -> dict:
    tok = model.backbone.tokenizer
    ids = [tok(p, return_tensors="pt").input_ids for p in prompts]
    runners = methods(model, args, table)
    if args.rows:
        runners = {k: v for k, v in runners.items() if k in args.rows or k == "hf_greedy"}
    # the warm-up run of each method (auto's one-off timing of the verify step included) is off the clock
    best = best_of({label: (lambda run: lambda: over_prompts(run, ids))(run) for label, run in runners.items()},
                   1 if args.tpf_only else args.reps, warm_up=not args.tpf_only)
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
    if "ar_sample" in rows:
        for label, row in rows.items():
            if sampled(label):
                row["speedup_vs_ar_sample"] = round(row["tokens_per_s"] / rows["ar_sample"]["tokens_per_s"], 3)
    return {"model": name, "heads": heads_label, "n": model.n_future, "prompts": prompts, "methods": rows,
            "_outputs": {label: r["outputs"] for label, r in best.items()}}


def first_kernels(m: dict, other: str | None) -> str:
    """`` / True`` where a row also equals the first kernels' transformers text (--cpu-linear A B)."""
    same = m.get("identical_to_" + other[len("speedup_vs_"):]) if other else None
    return "" if same is None else f" / {same}"


def print_table(r: dict) -> None:
    print(f"\n{r['model']}  heads: {r['heads']}  (n = {r['n']})")
    other = next((k for m in r["methods"].values() for k in m if k.startswith("speedup_vs_hf_greedy_")), None)
    extra = f" {'x HF ' + other.rsplit('_', 1)[1]:>12s}" if other else ""
    print(f"{'method':26s} {'tok/fwd':>8s} {'tok/s':>8s} {'x HF':>6s}{extra} {'x ar':>6s} {'nodes':>6s} identical")
    for label, m in r["methods"].items():
        col = f" {m.get(other, float('nan')):12.2f}" if other else ""
        print(f"{label:26s} {m.get('tokens_per_forward', float('nan')):8.3f} {m['tokens_per_s']:8.1f} "
              f"{m.get('speedup_vs_hf_greedy', float('nan')):6.2f}{col} {m.get('speedup_vs_ar_sample', float('nan')):6.2f} "
              f"{m.get('tree_nodes', '') or '':>6} {'-' if m['identical'] is None else m['identical']}{first_kernels(m, other)}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    run = Bench("tree", args, device=args.device, dtype=args.dtype, cpu_linear=args.cpu_linear,
                  max_new_tokens=args.max_new_tokens, reps=1 if args.tpf_only else args.reps)
    record = run.record
    if not args.no_embedded:
        emb, label = load(str(DEFAULT_BASE), args.embedded_heads, args.device, args.dtype, args.cpu_linear[0])
        table = open_table(args.embedded_stats, emb.backbone.tokenizer)
        record["embedded"] = bench("stories260K (embedded)", emb, label, PROMPTS["stories"], args, table)
    if args.smollm2:
        for kind in args.cpu_linear:
            smol, label = load(str(fetch("smollm2")), args.smollm2_heads, args.device, args.dtype, kind)
            table = open_table(str(SMOLLM2_STATS), smol.backbone.tokenizer)
            key = "smollm2" if kind == args.cpu_linear[0] else f"smollm2_{kind}"
            record[key] = bench(f"{SMOLLM2} ({kind} linears)", smol, label, list(TABLE7_PROMPTS), args, table)
            del smol
        first = record.get("smollm2", {}).get("methods", {}).get("hf_greedy")
        first_text = record.get("smollm2", {}).get("_outputs", {}).get("hf_greedy")
        for kind in args.cpu_linear[1:]:  # every row also against the first kernels' transformers
            later = record[f"smollm2_{kind}"]
            for label, row in later["methods"].items():
                if first:
                    row[f"speedup_vs_hf_greedy_{args.cpu_linear[0]}"] = round(row["tokens_per_s"] / first["tokens_per_s"], 3)
                if first_text is not None and not sampled(label):
                    row[f"identical_to_hf_greedy_{args.cpu_linear[0]}"] = later["_outputs"][label] == first_text
    for part in record.values():
        if isinstance(part, dict):
            part.pop("_outputs", None)
    if args.pythia_heads:
        pm, label = load(args.pythia_mini, args.pythia_heads, args.device, args.dtype, args.cpu_linear[0])
        record["pythia_mini"] = bench("pythia-mini", pm, label, PROMPTS["pile"], args)
    run.save()
    for key in ("embedded", "pythia_mini", *[k for k in record if k.startswith("smollm2")]):
        if key in record:
            print_table(record[key])
    return record


if __name__ == "__main__":
    main()
