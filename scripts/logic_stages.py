"""Per-stage timing of one DynaMo step's decoding logic (used by ``bench_decode.py --logic-only``).

Stages, for each kernel (dense = the whole k^n grid with opencv; numpy / numba = the sparse step):
top-k of the n heads, lookup (dense: the mask grid; sparse: the seen n-grams), grid + threshold
(values, normalisation, static threshold), blur + Otsu, penalty + sample; plus the whole
``dynamic_propose`` call, the number the targets are about. Steps are recorded head
distributions: from the embedded model with its heads (real candidates) or, for a table of
another tokenizer, distributions biased towards its frequent tokens (see ``synthetic_steps``).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import replace

import numpy as np
import torch

from multitoken.decoding.dynamo import sparse, step
from multitoken.decoding.config import DecodeConfig, numba_available
from multitoken.decoding.dynamo import dynamic_step, outer, prepare_kernel, repetition_cells, sample_index, top_candidates


def recorded_steps(model, table, prompts: list[list[int]], max_new: int) -> list[tuple[list[torch.Tensor], np.ndarray]]:
    """The heads' log-distributions and the context flags at every anchor of the model's own dense
    dynamic text at eps_b 0: each prompt is decoded, then the text is read back in one forward
    (the heads' rows at each position are the ones a step anchored there sees)."""
    from multitoken.decoding.engine import generate

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


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "loadavg": list(os.getloadavg()),
            "numba": None}
    if numba_available():
        import numba

        info["numba"] = numba.__version__
        info["numba_threads"] = numba.config.NUMBA_NUM_THREADS
    return info


def bench_stages(steps_by_n: dict, table, reps: int, eps_values=(0.0, 0.5)) -> dict:
    """Every kernel x order x eps_b; numba's compile / cache load timed first, apart."""
    kernels = ["dense", "numpy"] + (["numba"] if numba_available() else [])
    out = {"machine": machine(), "stats": str(table.path), "distinct": table.meta["distinct"]}
    if "numba" in kernels:
        start = time.perf_counter()
        prepare_kernel(DecodeConfig(dynamic_kernel="numba"), table, max(steps_by_n))
        out["numba_prepare_s"] = round(time.perf_counter() - start, 3)  # compile, or load from the disk cache
    for n, steps in steps_by_n.items():
        for eps in eps_values:
            cfg = DecodeConfig(mode="dynamic", top_k=50, eps_b=eps, temperature=0.7).resolved()
            for kernel in kernels:
                out[f"n{n}_eps{eps}_{kernel}"] = stage_times(steps, n, cfg, table, kernel, reps)
    out["machine"]["loadavg_end"] = list(os.getloadavg())
    return out
