"""Claim 2 (Mehra et al., Table 1): frozen backbone against joint LoRA finetuning, and the
three joint strategies, each on top of vanilla joint training:
heads only | joint (LoRA r = 8 on q/k/v) | head warm-up, then joint | differential head LR (4x) |
RMS loss balancing. Same data, seed, steps and base LR for all five.
Reported on held-out text: top-1 / top-5 of heads 2 and 3, and head 1's perplexity, which is
the (LoRA-tuned) base model's own next-token perplexity: joint training must not damage it
much. The untrained heads (copies of the final layer) are the reference row.

Model: pythia-mini (a pythia-14m-shaped GPT-NeoX), n = 3 replicated heads, heads 2..3
initialised as copies of the final layer; trained on tinyshakespeare's first 90%, scored on its
held-out tail (common.shakespeare_split). Base LR 5e-4: Mehra et al. train at half the
pretraining LR (pythia-mini was pretrained at 1e-3).

    python scripts/experiments/frozen_vs_joint.py [--quick] [--out DIR]
"""

from __future__ import annotations

import sys

from multitoken.pipeline.eval import experiment as common

NAME = "frozen_vs_joint"
FULL = common.Budget(steps=40, batch_size=4, seq_len=64, lr=5e-4, eval_tokens=4096, eval_batches=2)
QUICK = common.Budget(steps=2, batch_size=2, seq_len=16, lr=5e-4, eval_tokens=64, eval_batches=1)
HEADS = {"head_type": "replicated", "n_future": 3, "init": "copy"}


def strategies(steps: int) -> dict[str, dict]:
    """Name -> TrainConfig fields; every joint row is vanilla joint plus one strategy."""
    return {
        "heads only": {"mode": "heads"},
        "joint": {"mode": "joint"},
        "warm-up + joint": {"mode": "warmup", "head_warmup_steps": max(steps // 2, 1)},
        "joint + diff. LR 4x": {"mode": "joint", "head_lr_mult": 4.0},
        "joint + RMS balance": {"mode": "joint", "loss_balance": "rms"},
    }


def summarize(report: dict) -> dict:
    h = {row["head"]: row for row in common.head_rows(report)}
    return {"head1_ppl": h[1]["ppl"], "head1_top1": h[1]["top1"], "head1_top5": h[1]["top5"],
            "head2_top1": h[2]["top1"], "head2_top5": h[2]["top5"], "head3_top1": h[3]["top1"], "head3_top5": h[3]["top5"],
            "head2_ppl": h[2]["ppl"], "head3_ppl": h[3]["ppl"]}


def main(argv=None) -> dict:
    args = common.parser(__doc__, NAME).parse_args(argv)
    run = common.Run(NAME, args, FULL, QUICK)
    b = run.budget
    train_data, heldout = common.shakespeare_split(run.work, args.quick)
    backbone = common.load_base(common.PYTHIA_MINI)
    rows = []
    for name, fields in strategies(b.steps).items():
        trained = common.train_heads(run, name.replace(" ", "_").replace("/", ""), backbone, HEADS, train_data, heldout, **fields)
        if not rows:  # the untrained copies: the base model's own numbers
            report = common.evaluate_on(run, "untrained", common.load_heads(trained["init"]), heldout)
            rows.append({"strategy": "untrained (reference)", **summarize(report)})
        report = common.evaluate_on(run, name, common.load_heads(trained["heads"]), heldout)
        rows.append({"strategy": name, **summarize(report), "train_seconds": trained["train_seconds"]})
        print(f"{name}: head1 ppl {rows[-1]['head1_ppl']:.1f}, top-5 heads 2/3 "
              f"{rows[-1]['head2_top5']:.3f}/{rows[-1]['head3_top5']:.3f}", file=sys.stderr)
    result = {"model": "pythia-mini", "n_future": 3, "heads": HEADS, "rows": rows,
              "strategies": strategies(b.steps), "lora": {"r": 8, "alpha": 16, "targets": "q/k/v (query_key_value)"},
              "data": {"train": "tinyshakespeare, first 90% of the characters",
                       "heldout": f"tinyshakespeare tail, first {b.eval_tokens} tokens"}}
    return run.finish(result, plot(rows))


def plot(rows: list[dict]):
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120)
    names = [r["strategy"] for r in rows]
    x = range(len(rows))
    width = 0.2
    for i, (key, label) in enumerate((("head2_top1", "head 2 top-1"), ("head2_top5", "head 2 top-5"),
                                      ("head3_top1", "head 3 top-1"), ("head3_top5", "head 3 top-5"))):
        ax1.bar([j + (i - 1.5) * width for j in x], [r[key] for r in rows], width, label=label)
    ax1.set_xticks(list(x), names, rotation=25, ha="right", fontsize=7)
    ax1.set_ylabel("held-out accuracy")
    ax1.legend(fontsize=7)
    ax1.grid(axis="y", alpha=0.3)
    ax2.bar(list(x), [r["head1_ppl"] for r in rows], color="grey")
    ax2.set_xticks(list(x), names, rotation=25, ha="right", fontsize=7)
    ax2.set_ylabel("head 1 (base) perplexity")
    ax2.set_ylim(min(r["head1_ppl"] for r in rows) * 0.95, max(r["head1_ppl"] for r in rows) * 1.02)
    ax2.grid(axis="y", alpha=0.3)
    fig.suptitle("Frozen vs joint (pythia-mini, n = 3, tinyshakespeare held-out tail)", fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
