"""Per-stage timing of one DynaMo step's decoding logic, next to one forward of a
pythia-70m-shaped model for scale (seconds, not minutes):

    python scripts/bench_logic.py --out bench_logic.json [--logic-stats DIR]

Stages, for each kernel (dense = the whole k^n grid with opencv; numpy / numba = the sparse step):
top-k of the n heads, lookup (dense: the mask grid; sparse: the seen n-grams), grid + threshold
(values, normalisation, static threshold), blur + Otsu, penalty + sample; plus the whole
``dynamic_propose`` call, the number the targets are about. Steps are recorded head
distributions: from the embedded model with its heads (real candidates) or, for a table of
another tokenizer, distributions biased towards its frequent tokens (see ``synthetic_steps``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from multitoken.decoding.config import DecodeConfig, numba_available
from multitoken.decoding.dynamo import (dynamic_step, outer, prepare_kernel, repetition_cells, sample_index, sparse, step,
                                        top_candidates)
from multitoken.decoding.engine import generate
from multitoken.embedded import DEFAULT_BASE, EMBEDDED_HEADS, EMBEDDED_STATS
from multitoken.pipeline.eval.benchmark import PROMPTS, Bench, add_out, load, open_table
from multitoken.pipeline.model.backbone import Backbone
from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.stats.table import CooccurrenceTable


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "bench_logic.json")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--embedded-heads", default=str(EMBEDDED_HEADS))
    p.add_argument("--embedded-stats", default=str(EMBEDDED_STATS))
    p.add_argument("--logic-stats", default=None,
                   help="a big stats dir (any tokenizer) for a second timing, e.g. the table "
                        "scripts/bench_stats.py --work DIR leaves in DIR/merged")
    p.add_argument("--logic-new-tokens", type=int, default=120, help="tokens per prompt of the recorded dynamic decoding (the steps timed)")
    p.add_argument("--logic-reps", type=int, default=5, help="passes over the recorded steps per timing")
    return p.parse_args(argv)


def recorded_steps(model, table, prompts: list[list[int]], max_new: int) -> list[tuple[list[torch.Tensor], np.ndarray]]:
    """The heads' log-distributions and the context flags at every anchor of the model's own dense
    dynamic text at eps_b 0: each prompt is decoded, then the text is read back in one forward
    (the heads' rows at each position are the ones a step anchored there sees)."""
    steps = []
    vocab = model.backbone.vocab_size
    for p in prompts:
        cfg = DecodeConfig(mode="dynamic", eps_b=0.0, max_new_tokens=max_new, stop_at_eos=False, dynamic_kernel="dense")
        ids = list(p) + generate(model, p, cfg, table=table).token_ids
        logps = model.head_logits(torch.tensor([ids], device=model.backbone.device), last_only=False)  # n x [1, T, V]
        seen = np.zeros(vocab, dtype=bool)
        seen[ids[:len(p) - 1]] = True
        for pos in range(len(p) - 1, len(ids) - 1):
            seen[ids[pos]] = True  # the context up to the anchor, the anchor included
            steps.append(([lp[0, pos].float().cpu() for lp in logps], seen.copy()))
    return steps


def synthetic_steps(table, n: int, count: int, seed: int = 0):
    """Head distributions over the table's vocabulary leaning to its frequent tokens (log unigram
    count + noise), so that the top-50 lists meet seen n-grams as real heads do."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.log1p(torch.from_numpy(np.asarray(table.unigrams, np.float64))).float()
    seen = np.zeros(table.vocab_size, dtype=bool)
    seen[torch.randint(0, table.vocab_size, (128,), generator=gen).numpy()] = True
    return [([torch.log_softmax(base + 2.0 * torch.randn(table.vocab_size, generator=gen), -1) for _ in range(n)], seen)
            for _ in range(count)]


def _median_ms(times: list[float]) -> float:
    return round(1000 * statistics.median(times), 4)


def stage_times(steps, n: int, cfg: DecodeConfig, table, kernel: str, reps: int) -> dict:
    """Median ms per stage of the order-n grid (no back-off) and of the whole proposal."""
    k = cfg.sampling.top_k
    temperature = cfg.sampling.temperature
    threshold = np.float32(cfg.dynamo.eps_b ** (n - 1))
    stages = {s: [] for s in ("topk", "lookup", "grid_threshold", "blur_otsu", "penalty_sample", "dynamic_propose")}
    cells_seen, live = [], []
    rng = np.random.default_rng(0)
    lay = sparse.layout(table, n) if kernel != "dense" else None
    if kernel == "numba":
        from multitoken.decoding.dynamo import numba_step
    for _ in range(reps):
        for logps, seen in steps:
            t = [time.perf_counter()]
            cands = [top_candidates(lp, k, temperature) for lp in logps[:n]]
            t.append(time.perf_counter())
            if kernel == "dense":
                mask = step._lookup(table, cands, cfg.dynamo.alpha_c)
                t.append(time.perf_counter())
                grid = outer(cands) * mask
                nz = grid[grid != 0]
                total = nz.sum(dtype=np.float64)
                grid = grid / np.float32(total) if total > 0 else outer(cands)
                if threshold > 0:
                    grid[grid <= threshold] = 0.0
                t.append(time.perf_counter())
                flat, values = step._live(grid, cfg)
                cells_seen.append(nz.size)
            else:
                ids = [c.ids for c in cands]
                if kernel == "numba":
                    flat, count = numba_step.seen_cells(lay, ids)
                    t.append(time.perf_counter())
                    flat, masked = numba_step.masked_values(lay, cands, flat, count, cfg.dynamo.alpha_c)
                else:
                    flat, count = sparse.seen_cells(lay, ids)
                    t.append(time.perf_counter())
                    flat, masked = sparse.masked_values(lay, cands, flat, count, cfg.dynamo.alpha_c)
                values = masked / np.float32(masked.sum(dtype=np.float64))
                if threshold > 0:
                    keep = values > threshold
                    flat, values = flat[keep], values[keep]
                t.append(time.perf_counter())
                no_static = replace(cfg, static_threshold=False)
                live_fn = numba_step.live if kernel == "numba" else sparse.live_cells
                flat, values = live_fn(flat, values, tuple(c.ids.size for c in cands), no_static, threshold)
                cells_seen.append(masked.size)
            t.append(time.perf_counter())
            if flat.size:
                values[repetition_cells(cands, seen, np.unravel_index(flat, (k,) * n))] /= np.float32(cfg.sampling.penalty)
                np.unravel_index(flat[sample_index(values, rng)], (k,) * n)
            t.append(time.perf_counter())
            live.append(flat.size)
            for name, a, b in zip(stages, t[:-1], t[1:]):
                stages[name].append(b - a)
            start = time.perf_counter()
            dynamic_step(logps[:n], replace(cfg, dynamic_kernel=kernel), table, seen, rng)
            stages["dynamic_propose"].append(time.perf_counter() - start)
    out = {name: _median_ms(v) for name, v in stages.items()}
    out["stages_sum"] = round(sum(out[s] for s in list(stages)[:-1]), 4)
    out["seen_cells_median"] = int(statistics.median(cells_seen))
    out["live_cells_median"] = int(statistics.median(live))
    return out


def numba_facts() -> dict:
    if not numba_available():
        return {"numba": None}
    import numba

    return {"numba": numba.__version__, "numba_threads": numba.config.NUMBA_NUM_THREADS}


def bench_stages(steps_by_n: dict, table, reps: int, eps_values=(0.0, 0.5)) -> dict:
    """Every kernel x order x eps_b; numba's compile / cache load timed first, apart."""
    kernels = ["dense", "numpy"] + (["numba"] if numba_available() else [])
    out = {**numba_facts(), "stats": str(table.path), "distinct": table.meta["distinct"]}
    if "numba" in kernels:
        start = time.perf_counter()
        prepare_kernel(DecodeConfig(dynamic_kernel="numba"), table, max(steps_by_n))
        out["numba_prepare_s"] = round(time.perf_counter() - start, 3)  # compile, or load from the disk cache
    for n, steps in steps_by_n.items():
        for eps in eps_values:
            cfg = DecodeConfig(mode="dynamic", top_k=50, eps_b=eps, temperature=0.7).resolved()
            for kernel in kernels:
                out[f"n{n}_eps{eps}_{kernel}"] = stage_times(steps, n, cfg, table, kernel, reps)
    return out


def pythia70m_shaped() -> MultiTokenModel:
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=50304, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                        intermediate_size=2048, max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True)
    model = GPTNeoXForCausalLM(cfg).eval()
    bb = Backbone(model, None, "pythia-70m-shaped (random)", BackboneConfig(base="random"))
    return MultiTokenModel.attach(bb, {"head_type": "medusa", "n_future": 3})


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
        print(f"\n{key}: {r['stats']} ({r['steps']} steps), numba {r['numba']}, prepare {r.get('numba_prepare_s')} s")
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
    bench = Bench("logic", args, logic_new_tokens=args.logic_new_tokens, logic_reps=args.logic_reps)
    bench["logic"] = bench_logic(args)
    record = bench.save()
    print_logic(record["logic"])
    return record


if __name__ == "__main__":
    main()
