"""Claim 1 (the CP-heads paper, Fig. 2 and Tables 1-2): CP rank 1, 2, 4, 8 on the same data,
seed and step budget. Expected: the joint loss of tokens 2..n falls as the rank grows, the
first-token loss stays; speculative tokens per forward rise with the rank; rank 1 is the
independent-heads model.

Model: the embedded stories260K (a TinyStories Llama, as the paper's nanoGPT), n = 3 CP heads
trained with the backbone frozen (the paper's head-only setting, its Table 2) on the base's
own samples; scored on held-out samples drawn with another seed (common.HELDOUT_SEED).
Speculative decoding: lossless sampling of the base distribution (temperature 1, no top-k,
no repetition penalty), drafts sampled sequentially from the CP mixture (``drafter="cp"``)
and, for comparison, from each head on its own (``independent``).

    python scripts/experiments/cp_rank.py [--quick] [--out DIR]
"""

from __future__ import annotations

import sys

import torch

from multitoken.pipeline.eval import experiment as common

NAME = "cp_rank"
RANKS = (1, 2, 4, 8)
FULL = common.Budget(steps=120, batch_size=8, seq_len=128, lr=3e-3, train_tokens=20_000, eval_tokens=8_192,
                     eval_batches=4, new_tokens=64, prompts=6, seeds=2)
QUICK = common.Budget(steps=2, batch_size=2, seq_len=32, lr=3e-3, train_tokens=1_500, eval_tokens=256,
                      eval_batches=1, new_tokens=8, prompts=1, seeds=1)


def spec_tokens_per_forward(model, prompts: list[str], seeds: int, new_tokens: int, drafter: str) -> dict:
    """Mean tokens per forward (and per verification step) of lossless speculative sampling."""
    from multitoken.decoding import DecodeConfig, generate

    tok, vocab = model.backbone.tokenizer, model.backbone.vocab_size
    tpf, per_step = [], []
    for prompt in prompts:
        ids = tok(prompt)["input_ids"]
        for seed in range(seeds):
            cfg = DecodeConfig(mode="speculative", drafter=drafter, temperature=1.0, top_k=vocab, repetition_penalty=1.0,
                               max_new_tokens=new_tokens, stop_at_eos=False, seed=seed)
            trace = generate(model, ids, cfg).trace
            tpf.append(trace.tokens_per_forward)
            steps = sum(trace.accepted_lengths.values())
            per_step.append(sum((k + 1) * c for k, c in trace.accepted_lengths.items()) / max(steps, 1))
    return {"tokens_per_forward": sum(tpf) / len(tpf), "tokens_per_step": sum(per_step) / len(per_step), "runs": len(tpf)}


@torch.no_grad()
def sequential_vs_independent(model, heldout_ids: torch.Tensor) -> float:
    """max |log P(x_{t+2} | x_{t+1}) - log P_2(x_{t+2})| over held-out positions: the CP
    posterior update (eqs. 11-13) against head 2's own marginal; 0 means independent heads."""
    feats = model.features(heldout_ids)  # [B, T, H] each
    e = feats.base[:, :-1].reshape(-1, feats.base.shape[-1])  # [N, H]
    prefix = heldout_ids[:, 1:].reshape(-1, 1)  # [N, 1]: the token t+1 each position saw
    cond = model.heads.conditional_log_probs(e, prefix)  # [N, V]
    marginal = model.heads.log_probs(1, feats)[:, :-1].reshape(cond.shape)  # [N, V]
    return float((cond - marginal).abs().max())


def heldout_batch(model, path: str, budget) -> torch.Tensor:
    from multitoken.base.data import DataConfig
    from multitoken.base.packing import PackedStream

    tok = model.backbone.tokenizer
    stream = PackedStream(DataConfig(data=path), tok, budget.seq_len, tok.bos_token_id, loop=False)
    rows = [torch.as_tensor(seq) for seq, _ in zip((s for s, _ in stream), range(2))]
    return torch.stack(rows)  # [2, T]


def main(argv=None) -> dict:
    args = common.parser(__doc__, NAME).parse_args(argv)
    run = common.Run(NAME, args, FULL, QUICK)
    b = run.budget
    backbone = common.load_base(None)
    with run.timed("distill"):
        train_data = common.story_samples(run.work, backbone, b.train_tokens, common.TRAIN_SEED, "train")
        heldout = common.story_samples(run.work, backbone, max(b.eval_tokens, 2 * b.eval_batches * b.batch_size * b.seq_len),
                                       common.HELDOUT_SEED, "heldout")
    prompts = common.story_prompts(b.prompts)
    rows = []
    for rank in RANKS:
        trained = common.train_heads(run, f"rank{rank}", backbone, {"head_type": "cp", "n_future": 3, "rank": rank},
                                     train_data, heldout, separator="bos")
        ev = trained["train_eval"]
        model = common.load_heads(trained["heads"])
        with run.timed(f"decode rank {rank}"):
            cp = spec_tokens_per_forward(model, prompts, b.seeds, b.new_tokens, "cp")
            indep = spec_tokens_per_forward(model, prompts, b.seeds, b.new_tokens, "independent")
        rows.append({
            "rank": rank, "joint_loss": ev["cp/joint_nll"], "first_token_loss": ev["head1/loss"],
            "joint_loss_tokens_2_to_n": ev["cp/joint_nll"] - ev["head1/loss"],
            "head_losses": [ev[f"head{s}/loss"] for s in (1, 2, 3)], "head_top1": [ev[f"head{s}/top1"] for s in (1, 2, 3)],
            "max_expert_share": ev.get("cp/max_expert_share"), "aux_eq10": ev.get("cp/aux_eq10"),
            "spec_cp": cp, "spec_independent": indep,
            "sequential_minus_independent_max_abs": sequential_vs_independent(model, heldout_batch(model, heldout, b)),
            "train_seconds": trained["train_seconds"],
        })
        print(f"rank {rank}: joint {rows[-1]['joint_loss']:.3f} (2..n {rows[-1]['joint_loss_tokens_2_to_n']:.3f}), "
              f"first {rows[-1]['first_token_loss']:.3f}, tokens/forward cp {cp['tokens_per_forward']:.2f}", file=sys.stderr)
    result = {"model": "embedded stories260K", "n_future": 3, "ranks": list(RANKS), "rows": rows,
              "data": {"train": f"{b.train_tokens} tokens sampled from the base, seed {common.TRAIN_SEED}",
                       "heldout": f"base samples, seed {common.HELDOUT_SEED}; eval {b.eval_batches} x {b.batch_size} x {b.seq_len} tokens"},
              "decoding": {"mode": "speculative (lossless sampling)", "temperature": 1.0, "top_k": "vocabulary",
                           "repetition_penalty": 1.0, "prompts": prompts, "seeds": b.seeds, "new_tokens": b.new_tokens}}
    return run.finish(result, plot(rows))


def plot(rows: list[dict]):
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120)
    ranks = [r["rank"] for r in rows]
    ax1.plot(ranks, [r["joint_loss_tokens_2_to_n"] for r in rows], "o-", label="joint loss, tokens 2..3 | token 1")
    ax1.plot(ranks, [r["first_token_loss"] for r in rows], "s-", label="first-token loss")
    ax1.plot(ranks, [r["joint_loss"] for r in rows], "^--", label="joint loss, tokens 1..3")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("CP rank")
    ax1.set_ylabel("held-out loss (nats)")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    ax2.plot(ranks, [r["spec_cp"]["tokens_per_forward"] for r in rows], "o-", label="drafter cp (sequential)")
    ax2.plot(ranks, [r["spec_independent"]["tokens_per_forward"] for r in rows], "s--", label="drafter independent")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("CP rank")
    ax2.set_ylabel("tokens per forward")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.suptitle("CP rank (stories260K, n = 3, heads only)", fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
