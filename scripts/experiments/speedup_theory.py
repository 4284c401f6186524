"""Claim 6 (speculative sampling, Leviathan et al.; Medusa trees): the speed-up the theory
predicts from measured acceptance, next to the one measured, for chain and tree verification.

Predictions (``pipeline.eval.speedup``, ``decoding.trees.expected_accepted``):
- from held-out teacher-forced accuracies (``evaluate``: head d's top-1, and its per-rank
  accuracies): chain E[tokens / step] = 1 + sum_k prod_{i<=k} acc_i; static tree = 1 + the
  tree's expected accepted drafts (Medusa's rule, the sum of its nodes' path products);
- from the acceptance measured while decoding (alpha = drafts kept / drafts verified while the
  chain was alive): Leviathan's E = (1 - alpha^(g+1)) / (1 - alpha) and wall-time factor
  E / (g c + 1) with c = the heads' cost ratio (``draft_cost_ratio``).
Measured: tokens per verification step (and per forward, prefill included) and the CPU-time
speed-up over greedy / sampled ``ar`` on the same prompts (CPU time: other processes on a shared
machine do not inflate it). Chain and trees are greedy (argmax verification: the output is the
base model's greedy text); the sampled chain uses temperature 1, no top-k, no penalty.

Model: the embedded stories260K with its shipped heads (n = 3); held-out text for the
accuracies: base samples drawn with common.HELDOUT_SEED.

    python scripts/experiments/speedup_theory.py [--quick] [--out DIR]
"""

from __future__ import annotations

import sys
import time

from multitoken.pipeline.eval import experiment as common

NAME = "speedup_theory"
FULL = common.Budget(steps=0, batch_size=8, seq_len=128, eval_tokens=8192, new_tokens=128, prompts=6, seeds=2)
QUICK = common.Budget(steps=0, batch_size=2, seq_len=32, eval_tokens=128, new_tokens=8, prompts=1, seeds=1)
TREE_NODES = 16


def decode_all(model, prompts: list[str], seeds: int, cfg, tree_accuracies=None) -> dict:
    """Sum of the traces over prompts x seeds, with process CPU time."""
    from dataclasses import replace

    from multitoken.decoding import generate

    tok = model.backbone.tokenizer
    total = {"new_tokens": 0, "forwards": 0, "cpu_s": 0.0, "wall_s": 0.0, "accepted": {}}
    for prompt in prompts:
        for seed in range(seeds if not cfg.sampling.greedy else 1):  # greedy: one run per prompt
            cpu = time.process_time()
            trace = generate(model, tok(prompt)["input_ids"], replace(cfg, seed=seed), tree_accuracies=tree_accuracies).trace
            total["cpu_s"] += time.process_time() - cpu
            total["wall_s"] += trace.wall_s
            total["new_tokens"] += trace.new_tokens
            total["forwards"] += trace.forward_passes
            for k, c in trace.accepted_lengths.items():
                total["accepted"][int(k)] = total["accepted"].get(int(k), 0) + c
    steps = sum(total["accepted"].values())
    total["tokens_per_forward"] = total["new_tokens"] / max(total["forwards"], 1)
    total["tokens_per_step"] = sum((k + 1) * c for k, c in total["accepted"].items()) / steps if steps else 1.0
    total["cpu_per_token"] = total["cpu_s"] / max(total["new_tokens"], 1)
    return total


def prediction(row: dict) -> str:
    """The held-out formula's tokens per step for a result row, or why there is none: a dynamic
    tree's shape follows each step's own probabilities, so no fixed formula predicts it."""
    value = row.get("heldout_formula_tokens_per_step")
    if value is None:
        return "n/a (no formula for dynamic trees)"
    return f"{value:.2f} (held-out accuracies)"


def measured_alpha(accepted: dict[int, int], g: int) -> dict:
    """Per-head acceptance a_i = P(L >= i | L >= i - 1) and alpha = drafts kept / drafts verified."""
    steps = sum(accepted.values())
    at_least = [sum(c for k, c in accepted.items() if k >= i) / max(steps, 1) for i in range(g + 1)]  # P(L >= i)
    per_head = [at_least[i] / at_least[i - 1] if at_least[i - 1] else 0.0 for i in range(1, g + 1)]
    alpha = sum(at_least[1:]) / max(sum(at_least[:-1]), 1e-12)
    return {"per_head": per_head, "alpha": alpha}


def main(argv=None) -> dict:
    from multitoken.decoding import DecodeConfig
    from multitoken.decoding.trees import Accuracies, best_first, expected_accepted
    from multitoken.pipeline.eval import metrics as M
    from multitoken.pipeline.eval.speedup import draft_cost_ratio, expected_tokens, walltime_improvement
    from multitoken.pipeline.sources.assets import load_model

    args = common.parser(__doc__, NAME).parse_args(argv)
    run = common.Run(NAME, args, FULL, QUICK)
    b = run.budget
    model, heads_dir = load_model(None)
    model.train(False)
    g, c, vocab = model.n_future - 1, draft_cost_ratio(model), model.backbone.vocab_size
    with run.timed("distill"):
        heldout = common.story_samples(run.work, model.backbone, b.eval_tokens, common.HELDOUT_SEED, "heldout")
    report = common.evaluate_on(run, "accuracy", model, heldout)
    acc = Accuracies(report["tree"]["rank_accuracy"], "held-out eval")
    top1 = report["accept_length"]["draft_top1"]
    shape = best_first(acc.log_scores(g), TREE_NODES)
    prompts = common.story_prompts(b.prompts)
    greedy = dict(greedy=True, max_new_tokens=b.new_tokens, stop_at_eos=False)
    sampled = dict(temperature=1.0, top_k=vocab, repetition_penalty=1.0, max_new_tokens=b.new_tokens, stop_at_eos=False)
    configs = {
        "ar (greedy)": DecodeConfig(mode="ar", **greedy),
        "chain (greedy)": DecodeConfig(mode="speculative", drafter="independent", **greedy),
        f"static tree {TREE_NODES} (greedy)": DecodeConfig(mode="speculative", tree="static", tree_nodes=str(TREE_NODES), **greedy),
        f"dynamic tree {TREE_NODES} (greedy)": DecodeConfig(mode="speculative", tree="dynamic", tree_nodes=str(TREE_NODES), **greedy),
        "ar (sampled)": DecodeConfig(mode="ar", **sampled),
        "chain (sampled)": DecodeConfig(mode="speculative", drafter="independent", **sampled),
    }
    measured = {}
    for name, cfg in configs.items():
        with run.timed(name):
            measured[name] = decode_all(model, prompts, b.seeds, cfg, tree_accuracies=acc)
    rows = []
    for name, m in measured.items():
        if name.startswith("ar"):
            continue
        ar = measured["ar (greedy)" if "greedy" in name else "ar (sampled)"]
        row = {"method": name, "measured_tokens_per_step": m["tokens_per_step"], "measured_tokens_per_forward": m["tokens_per_forward"],
               "measured_cpu_speedup": ar["cpu_per_token"] / m["cpu_per_token"] if m["cpu_per_token"] else None,
               "accepted_lengths": m["accepted"]}
        if "tree" not in name:
            a = measured_alpha(m["accepted"], g)
            row.update(measured_acceptance=a, leviathan_tokens_per_step=expected_tokens(min(a["alpha"], 1.0), g),
                       leviathan_wall_speedup=walltime_improvement(min(a["alpha"], 1.0), g, c),
                       heldout_formula_tokens_per_step=M.expected_accept_length(top1))
        elif "static" in name:
            row["heldout_formula_tokens_per_step"] = 1.0 + expected_accepted(shape, acc.table)
        rows.append(row)
        print(f"{name}: measured {m['tokens_per_step']:.2f} tokens/step, predicted {prediction(row)}", file=sys.stderr)
    result = {"model": "embedded stories260K + shipped heads (n = 3)", "heads": heads_dir, "g": g, "draft_cost_ratio": c,
              "heldout": {"draft_top1": top1, "empirical_chain_tokens_per_step": report["accept_length"]["empirical_with_base_token"],
                          "rank_accuracy_top5": [row[:5] for row in acc.table], "tokens": report["tokens"]},
              "static_tree_shape": {"nodes": len(shape) - 1, "depths": list(shape.depths), "ranks": list(shape.ranks)},
              "rows": rows, "ar": {k: {x: measured[k][x] for x in ("cpu_per_token", "new_tokens")} for k in measured if k.startswith("ar")},
              "prompts": prompts, "new_tokens": b.new_tokens, "sampled_seeds": b.seeds,
              "data": {"heldout": f"{report['tokens']} tokens of base samples, seed {common.HELDOUT_SEED}"}}
    return run.finish(result, plot(rows))


def plot(rows: list[dict]):
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120)
    names = [r["method"] for r in rows]
    x = range(len(rows))
    series = (("heldout_formula_tokens_per_step", "predicted: held-out accuracies"),
              ("leviathan_tokens_per_step", "predicted: Leviathan, measured alpha"),
              ("measured_tokens_per_step", "measured"))
    for i, (key, label) in enumerate(series):
        ax1.bar([j + (i - 1) * 0.27 for j in x], [r.get(key) or 0 for r in rows], 0.27, label=label)
    ax1.set_xticks(list(x), names, rotation=20, ha="right", fontsize=7)
    ax1.set_ylabel("tokens per verification step")
    ax1.legend(fontsize=7)
    ax1.grid(axis="y", alpha=0.3)
    ax2.bar([j - 0.2 for j in x], [r.get("leviathan_wall_speedup") or 0 for r in rows], 0.4, label="predicted E / (g c + 1)")
    ax2.bar([j + 0.2 for j in x], [r["measured_cpu_speedup"] or 0 for r in rows], 0.4, label="measured (CPU time vs ar)")
    ax2.axhline(1.0, color="grey", ls=":")
    ax2.set_xticks(list(x), names, rotation=20, ha="right", fontsize=7)
    ax2.set_ylabel("speed-up over ar")
    ax2.legend(fontsize=7)
    ax2.grid(axis="y", alpha=0.3)
    fig.suptitle("Speculative speed-up: theory vs measured (stories260K, shipped heads)", fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
