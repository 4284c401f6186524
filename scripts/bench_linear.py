"""CPU linears for decoding: torch's stock ``F.linear`` against weights prepacked for oneDNN
(``--cpu-linear packed``, kernels/cpu_linear.py) and the compiled rows kernel
(``--cpu-linear rows``, gemv_rows.py; where it builds), side by side in one process.

Three parts, each printed as a table and written to the JSON:

``step``: one forward of M = 1..9 new tokens over a ``--context``-token KV cache (every row's
logits, as a verification step reads them), stock and packed interleaved per repetition (best
kept), as a ratio over the stock one-token step; per model, dtype and thread count. Models:
``--base DIR`` (a real checkpoint, e.g. SmolLM2-135M) and random-weight models of the shapes
``--shapes`` (pythia-160m / 410m, SmolLM2-135M: no download).

``generate`` (with ``--base``): transformers' greedy ``generate`` and our ``ar`` and
``speculative`` greedy (untrained copy heads: the step cost, not the speed-up), each on the
stock and on the packed linears of the same model object, tokens/s, and whether every output
equals transformers' on the stock model.

``memory`` (with ``--base``): peak and final RSS of a fresh process that loads the model and
decodes 16 tokens with ``ar``, stock against packed.

    python scripts/bench_linear.py --base DIR --shapes 160m 410m --dtypes float32 bfloat16 \\
        --threads 1 2 --out bench_linear.json
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys

import torch
from transformers import DynamicCache

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.kernels import cpu_linear
from multitoken.kernels.format_table import CODES
from multitoken.pipeline.eval.benchmark import SHAPES, Bench, add_out, best_of, random_lm
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel

# the compiled rows kernel where it builds here (gemv_rows.py), beside oneDNN's and torch's
ROWS_FLOAT = "rows_f32"  # step rows: the rows kernel with grid codes turned off (--cpu-linear rows-f32)
KINDS = (cpu_linear.STOCK, cpu_linear.PACKED) + ((cpu_linear.ROWS,) if cpu_linear.rows_usable() else ())
PROMPT = "The results of the study show that"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "bench_linear.json")
    p.add_argument("--base", default=None, help="a local checkpoint dir (e.g. SmolLM2-135M): step, generate and memory rows")
    p.add_argument("--shapes", nargs="*", default=["smol135m", "160m", "410m"], choices=sorted(SHAPES),
                   help="random-weight models of these shapes (step rows only)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rows", type=int, default=9, help="step rows for M = 1..ROWS new tokens")
    p.add_argument("--context", type=int, default=64, help="cached tokens before each step")
    p.add_argument("--reps", type=int, default=5, help="interleaved timed repetitions (best kept), after one untimed warm-up run of each")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per generate row")
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)  # internal: one memory measurement
    return p.parse_args(argv)


# Models ----------------------------------------------------------------------------------
def real(base: str, dtype: str, kind: str = cpu_linear.PACKED) -> MultiTokenModel:
    """The checkpoint with untrained copy heads (n = 3), linears as ``kind`` asks."""
    bb = load_backbone(BackboneConfig(base=base, dtype=dtype, cpu_linear=kind))
    return MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "copy"}).eval()


# Step cost -------------------------------------------------------------------------------
def _cached(model, context: int):
    cache = DynamicCache()
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    model(ids, past_key_values=cache, use_cache=True)
    return cache


@torch.inference_mode()
def step_costs(stock, rows: int, context: int, reps: int) -> dict:
    """ms per forward of M = 1..rows tokens, stock and packed (a packed deep copy per packed
    kind), interleaved."""
    models = {cpu_linear.STOCK: stock}
    for kind in KINDS[1:]:
        models[kind] = copy.deepcopy(stock)
        swapped = cpu_linear.pack(models[kind], kind)
    if any(cpu_linear.format_of(m) in CODES for m in models.get(cpu_linear.ROWS, stock).modules()):
        models[ROWS_FLOAT] = copy.deepcopy(stock)  # the rows kernel on float32 blocks: what the grids are worth
        cpu_linear.pack(models[ROWS_FLOAT], cpu_linear.ROWS_F32)
    caches = {kind: _cached(m, context) for kind, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    xs = {m: torch.randint(0, stock.config.vocab_size, (1, m), generator=gen) for m in range(1, rows + 1)}

    def step(kind: str, m: int):
        def run() -> dict:
            models[kind](xs[m], past_key_values=caches[kind], use_cache=True)
            return {}
        return run

    def back_to_context(key) -> None:  # off the clock: the cache as it was before the step
        extra = caches[key[0]].get_seq_length() - context
        if extra:
            caches[key[0]].crop(-extra)

    # every kind at one M in turn
    timed = best_of({(kind, m): step(kind, m) for m in range(1, rows + 1) for kind in models}, reps,
                    before=back_to_context)
    best = {key: r["wall_s"] for key, r in timed.items()}
    kinds = list(models)
    one = best[cpu_linear.STOCK, 1]
    return {"packed_linears": swapped, "stock_1_token_ms": round(1000 * one, 3),
            **{kind: {m: {"ms": round(1000 * best[kind, m], 3), "x_stock_1": round(best[kind, m] / one, 3)}
                      for m in range(1, rows + 1)} for kind in kinds}}


def bench_steps(args) -> dict:
    models = ([("base", args.base)] if args.base else []) + [(s, None) for s in args.shapes]
    out = {}
    for (label, base), dtype in [(m, d) for m in models for d in args.dtypes]:
        model = real(base, dtype, cpu_linear.STOCK).backbone.model if base else random_lm(label, dtype)
        for threads in args.threads:
            torch.set_num_threads(threads)
            out[f"{label}/{dtype}/{threads}t"] = {"model": base or label, "dtype": dtype, "threads": threads,
                                                  **step_costs(model, args.rows, args.context, args.reps)}
        del model
    return out


# Generate rows ---------------------------------------------------------------------------
def _hf(model, ids, new: int) -> list[int]:
    bb = model.backbone
    out = bb.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                            pad_token_id=bb.tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def _ours(mode: str):
    def run(model, ids, new: int) -> list[int]:
        return generate(model, ids, DecodeConfig(mode=mode, greedy=True, max_new_tokens=new)).token_ids
    return run


@torch.inference_mode()
def divergence(model, ids, ref: list[int], got: list[int]) -> dict | None:
    """Where ``got`` first departs from ``ref`` (stock transformers'): the position and the gap
    between the two tokens' logits on the stock kernels, relative to the top logit's size (a
    near-tie is a gap at the rounding level of the dtype), else None."""
    pos = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if pos is None:
        return None
    model.backbone.load_config.cpu_linear = cpu_linear.STOCK
    model.prepare_linears()
    context = torch.cat([ids, torch.tensor([ref[:pos]], dtype=ids.dtype)], dim=1)
    logits = model.backbone.model(context).logits[0, -1].float()  # [V]
    gap = float(logits[ref[pos]] - logits[got[pos]])  # the prefill's logits: its own rounding too, either sign
    return {"position": pos, "logit_gap": round(gap, 6), "relative_gap": round(gap / float(logits.abs().max()), 8),
            "dtype_eps": torch.finfo(model.backbone.embeddings.weight.dtype).eps}


def bench_generate(args) -> dict:
    """Each method on stock then packed linears of one model object, interleaved per repetition;
    the switch (``prepare_linears``) happens outside the timed call."""
    out = {}
    for dtype, threads in [(d, t) for d in args.dtypes for t in args.threads]:
        torch.set_num_threads(threads)
        model = real(args.base, dtype)
        ids = model.backbone.tokenizer(PROMPT, return_tensors="pt").input_ids
        methods = {"hf_greedy": _hf, "ar": _ours("ar"), "speculative_greedy": _ours("speculative")}
        def switch(key) -> None:
            model.backbone.load_config.cpu_linear = key[1]
            model.prepare_linears()  # transformers' generate gets the same kernels

        runs = {(label, kind): (lambda run: lambda: {"output": run(model, ids, args.max_new_tokens)})(run)
                for label, run in methods.items() for kind in KINDS}
        timed = best_of(runs, args.reps, before=switch)
        best = {key: r["wall_s"] for key, r in timed.items()}
        outputs = {key: r["output"] for key, r in timed.items()}
        ref = outputs["hf_greedy", cpu_linear.STOCK]
        out[f"{dtype}/{threads}t"] = {
            f"{label}_{kind}": {"tokens_per_s": round(len(outputs[label, kind]) / best[label, kind], 2),
                                "x_hf_stock": round(best["hf_greedy", cpu_linear.STOCK] / best[label, kind]
                                                    * len(outputs[label, kind]) / len(ref), 3),
                                "identical_to_hf_stock": outputs[label, kind] == ref,
                                "first_difference": divergence(model, ids, ref, outputs[label, kind])}
            for label, kind in best}
        del model
    return out


# Memory ----------------------------------------------------------------------------------
def _rss_mib() -> dict[str, float]:
    """Current and peak resident memory of this process (Linux: getrusage's peak would carry
    the parent's over the exec)."""
    with open("/proc/self/status") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}
    return {"rss_mib": round(kb["VmRSS"] / 1024, 1), "peak_rss_mib": round(kb["VmHWM"] / 1024, 1)}


def rss_child(args) -> None:
    """(In a fresh process) load, decode 16 tokens, print the RSS record as JSON."""
    torch.set_num_threads(1)
    model = real(args.base, args.dtypes[0], args.rss_child)
    generate(model, model.backbone.tokenizer(PROMPT, return_tensors="pt").input_ids,
             DecodeConfig(mode="ar", greedy=True, max_new_tokens=16))
    packed = sum(isinstance(m, cpu_linear.PackedLinear) for m in model.modules())
    print(json.dumps({**_rss_mib(), "packed_linears": packed}))


def bench_memory(args) -> dict:
    out = {}
    for dtype in args.dtypes:
        for kind in KINDS:
            cmd = [sys.executable, __file__, "--base", args.base, "--dtypes", dtype, "--rss-child", kind]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            out[f"{dtype}/{kind}"] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


# Report ----------------------------------------------------------------------------------
def print_report(record: dict) -> None:
    for key, r in record["step"].items():
        print(f"\n{key}: step over {record['settings']['context']} cached tokens, x the stock 1-token step "
              f"({r['stock_1_token_ms']} ms; {r['packed_linears']} linears packed)")
        rows = sorted(r[cpu_linear.STOCK], key=int)
        print(f"{'M':>8s} " + " ".join(f"{m:>6}" for m in rows))
        for kind in [k for k in r if isinstance(r[k], dict)]:
            print(f"{kind:>8s} " + " ".join(f"{r[kind][m]['x_stock_1']:6.2f}" for m in rows))
    for key, rows in record.get("generate", {}).items():
        print(f"\ngenerate {key} ({record['settings']['max_new_tokens']} tokens):")
        for label, m in rows.items():
            diff = m["first_difference"]
            tie = (f"  (from token {diff['position']}: stock logit gap {diff['logit_gap']:.2g}, "
                   f"{diff['relative_gap']:.1e} of the top logit; eps {diff['dtype_eps']:.1e})") if diff else ""
            print(f"  {label:26s} {m['tokens_per_s']:8.2f} tok/s  x{m['x_hf_stock']:5.2f}  identical {m['identical_to_hf_stock']}{tie}")
    for key, m in record.get("memory", {}).items():
        print(f"memory {key:18s} peak {m['peak_rss_mib']:8.1f} MiB  final {m['rss_mib']:8.1f} MiB  packed {m['packed_linears']}")
    print("load average before / after:", record["load_before"], record["load_after"])


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.rss_child:
        return rss_child(args)
    run = Bench("linear", args, onednn_usable=cpu_linear.usable(), context=args.context, reps=args.reps,
                  max_new_tokens=args.max_new_tokens)
    record = run.record
    parts = {"step": bench_steps, **({"generate": bench_generate, "memory": bench_memory} if args.base else {})}
    for key, bench in parts.items():  # the JSON after each part: a long run stopped keeps what it measured
        record[key] = bench(args)
        run.save()
    print_report(record)
    return record


if __name__ == "__main__":
    main()
