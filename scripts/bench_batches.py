"""The batch bench: the same work at every batch
size B (max(B) prompts of different lengths, each seeded by its index), decoded B rows at a time
by transformers' batched greedy ``generate`` (left-padded) and by every mode of ours (greedy
static / dynamic trees too),
interleaved per repetition; tokens/s, tokens per forward per row (the same rows at every B),
peak memory and whether every row equals its B = 1 output; on the embedded default and on
pythia-mini (``--heads DIR``: trained heads).

    python scripts/bench_batches.py --batch-sizes 1 2 4 8 16 --out bench_batch.json [--heads DIR] [--device cuda]
"""

from __future__ import annotations

import argparse
import resource
import statistics
from pathlib import Path

import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate_batch
from multitoken.embedded import DEFAULT_BASE
from multitoken.pipeline.eval.benchmark import PROMPTS, Bench, add_out, best_of, decode_arguments, load, open_table, sampling


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "bench_batch.json")
    decode_arguments(p, 128)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16], help="batch sizes B")
    p.add_argument("--batch-eps", type=float, default=0.5, help="eps_b of the dynamic row (the same-quality point)")
    p.add_argument("--batch-tree-nodes", type=int, default=16,
                   help="node budget of the greedy static / dynamic tree rows (0: no tree rows)")
    return p.parse_args(argv)


def batch_prompts(texts: list[str], count: int) -> list[str]:
    """``count`` prompts of different lengths: the texts, then each extended by the next ones."""
    out = []
    for i in range(count):
        base = texts[i % len(texts)]
        extra = " ".join(texts[(i + j) % len(texts)] for j in range(1, 1 + i // len(texts)))
        out.append(f"{base} {extra}".strip())
    return out


def hf_batched_greedy(model, texts: list[str], max_new: int):
    """transformers' batched greedy ``generate``: left-padded prompts with their attention mask."""
    bb = model.backbone
    tok = bb.tokenizer
    side, tok.padding_side = tok.padding_side, "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(texts, return_tensors="pt", padding=True).to(bb.device)
    tok.padding_side = side
    out = bb.model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
    return [row[enc.input_ids.shape[1]:].tolist() for row in out], None


def peak_memory_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_mb(device: str) -> float:
    """Peak accelerator memory since the reset; on the CPU the process's peak RSS (monotonic)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_batch_model(name, model, heads_label, table, texts, args) -> dict:
    """Every method at every batch size (interleaved per repetition, best repetition kept)."""
    n, new = model.n_future, args.max_new_tokens
    sample = sampling(args)
    base = dict(max_new_tokens=new, n=n, stop_at_eos=False)
    cfgs = {"ar": DecodeConfig(mode="ar", greedy=True, max_new_tokens=new, stop_at_eos=False),
            "speculative_greedy": DecodeConfig(mode="speculative", greedy=True, **base),
            "speculative_sample": DecodeConfig(mode="speculative", **base, **sample),
            "typical_greedy": DecodeConfig(mode="typical", greedy=True, **base),
            f"dynamic_eps{args.batch_eps}": DecodeConfig(mode="dynamic", eps_b=args.batch_eps, **base, **sample)}
    nodes = args.batch_tree_nodes
    for tree in ("static", "dynamic") if nodes else ():  # every row's tree verified in one pass per step
        cfgs[f"{tree}_tree{nodes}_greedy"] = DecodeConfig(mode="speculative", greedy=True, tree=tree, tree_nodes=str(nodes), **base)
    tok = model.backbone.tokenizer
    pool = batch_prompts(texts, max(args.batch_sizes))  # the same work at every B: all of it, B rows at a time
    pool_ids = [tok(t)["input_ids"] for t in pool]
    out = {}
    singles: dict[str, list] = {}
    for b in args.batch_sizes:
        starts = range(0, len(pool), b)
        runs = {"hf_greedy_batched": lambda: _chunked([hf_batched_greedy(model, pool[i:i + b], new) for i in starts])}
        for label, cfg in cfgs.items():
            runs[label] = (lambda c: lambda: _chunked([_ours(model, pool_ids, i, b, c, table) for i in starts]))(cfg)
        cuda = args.device.startswith("cuda")
        best = best_of(runs, args.reps, before=lambda label: peak_memory_reset(args.device),
                       sync=torch.cuda.synchronize if cuda else (lambda: None),
                       after=lambda: {"peak_mb": peak_memory_mb(args.device)})
        rows = {}
        for label, r in best.items():
            tokens = sum(map(len, r["outputs"]))
            row = {"tokens": tokens, "wall_s": round(r["wall_s"], 4), "tokens_per_s": round(tokens / r["wall_s"], 1),
                   "peak_memory_mb": round(r["peak_mb"], 1)}
            if r["traces"] is not None:  # per row: the same prompts at every B, so comparable across B
                row["tokens_per_forward"] = round(statistics.mean(t.tokens_per_forward for t in r["traces"]), 3)
                row["forward_passes"] = r["passes"]  # batch passes over the whole work
            if b == min(args.batch_sizes) == 1:
                singles[label] = r["outputs"]
            if singles.get(label):
                row["rows_equal_batch1"] = r["outputs"] == singles[label]
            rows[label] = row
        for row in rows.values():
            row["speedup_vs_hf_batched"] = round(row["tokens_per_s"] / rows["hf_greedy_batched"]["tokens_per_s"], 3)
            row["speedup_vs_our_ar"] = round(row["tokens_per_s"] / rows["ar"]["tokens_per_s"], 3)
        out[str(b)] = rows
    for b in out:  # throughput over the same method at the smallest batch size
        for label, row in out[b].items():
            row["speedup_vs_smallest_batch"] = round(row["tokens_per_s"] / out[str(min(args.batch_sizes))][label]["tokens_per_s"], 3)
    return {"model": name, "heads": heads_label, "stats": bool(table), "n": n, "sampling": sample,
            "prompts": pool, "batch_sizes": out}


def _ours(model, pool_ids, first, b, cfg, table):
    """Rows first..first+b-1 of the pool as one batch, each seeded by its index in the pool (so a
    sampled row is the same at every B)."""
    ids = pool_ids[first:first + b]
    results = generate_batch(model, ids, cfg, seeds=list(range(first, first + len(ids))), table=table)
    return [r.token_ids for r in results], [r.trace for r in results]


def _chunked(parts: list[tuple]) -> dict:
    """The batches' (outputs, traces) joined, and the forward passes they took (the longest row's
    per batch: every live row shares a pass)."""
    outputs = [o for part in parts for o in part[0]]
    if parts[0][1] is None:
        return {"outputs": outputs, "traces": None, "passes": 0}
    traces = [t for part in parts for t in part[1]]
    return {"outputs": outputs, "traces": traces, "passes": sum(max(t.forward_passes for t in part[1]) for part in parts)}


def bench_batches(args) -> dict:
    out = {}
    emb, emb_heads = load(str(DEFAULT_BASE), args.embedded_heads, args.device, args.dtype, args.cpu_linear)
    out["embedded"] = bench_batch_model("stories260K (embedded)", emb, emb_heads,
                                        open_table(args.embedded_stats, emb.backbone.tokenizer), PROMPTS["stories"], args)
    if args.pythia_heads or Path(args.pythia_mini).is_dir():
        pm, pm_heads = load(args.pythia_mini, args.pythia_heads, args.device, args.dtype, args.cpu_linear)
        out["pythia_mini"] = bench_batch_model("pythia-mini", pm, pm_heads, open_table(args.pythia_stats, pm.backbone.tokenizer),
                                               PROMPTS["pile"], args)
    return out


def print_batches(batches: dict) -> None:
    for r in batches.values():
        print(f"\n{r['model']}  heads: {r['heads']}  stats: {r['stats']}  (tokens/s; x HF batched; x our ar; tok/fwd; peak MB)")
        for b, rows in r["batch_sizes"].items():
            print(f"B = {b}")
            for label, m in rows.items():
                print(f"  {label:22s} {m['tokens_per_s']:9.1f} {m['speedup_vs_hf_batched']:6.2f} {m['speedup_vs_our_ar']:6.2f} "
                      f"{m.get('tokens_per_forward', float('nan')):6.2f} {m['peak_memory_mb']:9.1f}  "
                      f"x B_min {m['speedup_vs_smallest_batch']:.2f}  {'' if m.get('rows_equal_batch1', True) else 'ROWS DIFFER FROM B=1'}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    bench = Bench("batches", args, device=args.device, dtype=args.dtype, cpu_linear=args.cpu_linear,
                  max_new_tokens=args.max_new_tokens, reps=args.reps, warm_up_runs=1)
    bench["batches"] = bench_batches(args)
    record = bench.save()
    print_batches(record["batches"])
    return record


if __name__ == "__main__":
    main()
