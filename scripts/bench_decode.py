"""Decoding benchmark: tokens/s of transformers' greedy ``generate`` and prompt-lookup decoding
against our ``ar``, ``speculative`` (greedy); of transformers' sampling ``generate`` (``hf_sample``)
against our ``ar`` sampling (``ar_sample``) and ``dynamic`` (eps_b 0.25 / 0.5 / 0.75 / 1), all
sampled rows at the same temperature, top-k and repetition penalty (transformers' penalty is its
logit form: a seen token's logit divided by the penalty if positive, else multiplied, before
temperature and top-k; ours is DynaMo's: the probability divided after them); on the embedded
stories260K model with its heads and on pythia-mini with heads; plus the per-step decoding-logic
time of the dynamic proposal (k = 50, n = 2, 3) next to a pythia-70m-shaped forward.

Every method decodes the same prompts; each repetition runs the methods interleaved and the best
repetition counts (the machine may be shared). Prints a table and writes JSON.

    python scripts/bench_decode.py --out bench_decode.json [--pythia-heads DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.dynamic import dynamic_propose
from multitoken.decoding.loop import generate
from multitoken.pipeline.model.backbone import Backbone, BackboneConfig, load_backbone
from multitoken.pipeline.embedded import EMBEDDED_HEADS, EMBEDDED_STATS
from multitoken.pipeline.embedded import DEFAULT_BASE
from multitoken.pipeline.model.model import MultiTokenModel

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
PROMPTS = {
    "stories": ["Once upon a time", "The little dog ran to the park and", "Lily and Ben were playing with a ball. Then"],
    "pile": ["The results of the study show that", "In computer science, a hash table is", "She walked into the room and"],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_decode.json")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the same for every method)")
    p.add_argument("--embedded-heads", default=str(EMBEDDED_HEADS))
    p.add_argument("--embedded-stats", default=str(EMBEDDED_STATS))
    p.add_argument("--pythia-mini", default=str(FIXTURES / "pythia-mini"))
    p.add_argument("--pythia-heads", default=None, help="heads trained for pythia-mini by scripts/build_heads.py (default: untrained copies)")
    p.add_argument("--pythia-stats", default=None, help="stats dir with the pythia tokenizer (dynamic masking on pythia-mini)")
    p.add_argument("--logic-stats", default=None,
                   help="stats dir of any tokenizer for the logic timing's mask lookups, e.g. the >= 10M-trigram table "
                        "scripts/bench_stats.py --work DIR leaves in DIR/merged (default: --pythia-stats, else no mask)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampled rows (DynaMo: 0.7)")
    p.add_argument("--top-k", type=int, default=50, help="sampled rows (DynaMo: 50)")
    p.add_argument("--repetition-penalty", type=float, default=1.1, help="sampled rows (DynaMo: 1.1; hf_sample: transformers' logit form)")
    p.add_argument("--logic-steps", type=int, default=200)
    p.add_argument("--logic-only", action="store_true", help="only the per-step decoding-logic timing (seconds, not minutes)")
    return p.parse_args(argv)


def load(base: str, heads: str | None):
    if heads and Path(heads).is_dir():
        return MultiTokenModel.from_pretrained(BackboneConfig(base=base), heads), heads
    bb = load_backbone(BackboneConfig(base=base))
    return MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "copy"}), "untrained (copy-initialised replicated, n=3)"


def open_table(path: str | None, tokenizer):
    if not path or not Path(path).is_dir():
        return None
    from multitoken.stats.table import CooccurrenceTable

    return CooccurrenceTable.for_tokenizer(path, tokenizer)


def hf_runner(model, prompt_lookup: bool, max_new: int, sample: dict | None = None):
    """transformers' ``generate``: greedy (optionally prompt lookup), or sampling with ``sample``
    = {temperature, top_k, repetition_penalty} (seeded through torch's global generator)."""
    bb = model.backbone
    extra = {"prompt_lookup_num_tokens": 10} if prompt_lookup else {}
    if sample:
        extra.update(top_p=1.0, **sample)

    def run(ids):
        if sample:
            torch.manual_seed(0)
        out = bb.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                do_sample=bool(sample), pad_token_id=bb.tokenizer.eos_token_id, **extra)
        return out[0, ids.shape[1]:].tolist(), None
    return run


def our_runner(model, cfg: DecodeConfig, table):
    def run(ids):
        res = generate(model, ids, cfg, table=table)
        return res.token_ids, res.trace
    return run


def bench_model(name, model, heads_label, table, prompts, args) -> dict:
    tok = model.backbone.tokenizer
    ids = [tok(p, return_tensors="pt").input_ids for p in prompts]
    n = model.n_future
    base = dict(max_new_tokens=args.max_new_tokens, n=n)
    sample = dict(temperature=args.temperature, top_k=args.top_k, repetition_penalty=args.repetition_penalty)
    methods = {
        "hf_greedy": hf_runner(model, False, args.max_new_tokens),
        "hf_prompt_lookup": hf_runner(model, True, args.max_new_tokens),
        "ar": our_runner(model, DecodeConfig(mode="ar", greedy=True, max_new_tokens=args.max_new_tokens), table),
        "speculative_greedy": our_runner(model, DecodeConfig(mode="speculative", greedy=True, **base), table),
        # two tokens per pass at most, but one head layer fewer per verification pass
        "speculative_greedy_n2": our_runner(model, DecodeConfig(mode="speculative", greedy=True, **{**base, "n": min(2, n)}), table),
    }
    # sampled rows: one setting for all (seed 0); ar_sample is the baseline of the dynamic rows
    methods["hf_sample"] = hf_runner(model, False, args.max_new_tokens, sample)
    methods["ar_sample"] = our_runner(model, DecodeConfig(mode="ar", max_new_tokens=args.max_new_tokens, **sample), table)
    for eps in (0.25, 0.5, 0.75, 1.0):
        methods[f"dynamic_eps{eps}"] = our_runner(model, DecodeConfig(mode="dynamic", eps_b=eps, **base, **sample), table)
    best: dict[str, dict] = {}
    for _ in range(args.reps):
        for label, run in methods.items():  # interleaved: load spikes hit every method alike
            start, tokens, outputs, traces = time.perf_counter(), 0, [], []
            for x in ids:
                out, trace = run(x)
                tokens, outputs = tokens + len(out), outputs + [out]
                traces.append(trace)
            wall = time.perf_counter() - start
            if label not in best or wall < best[label]["wall_s"]:
                best[label] = {"wall_s": wall, "tokens": tokens, "outputs": outputs, "traces": traces}
    rows = {}
    speed = {label: r["tokens"] / r["wall_s"] for label, r in best.items()}
    for label, r in best.items():
        row = {"tokens": r["tokens"], "wall_s": round(r["wall_s"], 4), "tokens_per_s": round(speed[label], 1),
               "speedup_vs_hf_greedy": round(speed[label] / speed["hf_greedy"], 3)}
        if label == "hf_sample" or label.endswith("_sample") or label.startswith("dynamic"):
            row["speedup_vs_ar_sample"] = round(speed[label] / speed["ar_sample"], 3)
        if r["traces"][0] is not None:
            fw = sum(t.forward_passes for t in r["traces"])
            row.update(forward_passes=fw, tokens_per_forward=round(r["tokens"] / fw, 3),
                       model_s=round(sum(t.model_s for t in r["traces"]), 4),
                       decoding_logic_s=round(sum(t.decoding_s for t in r["traces"]), 4),
                       logic_ms_per_forward=round(1000 * sum(t.decoding_s for t in r["traces"]) / fw, 3))
        if label in ("ar", "speculative_greedy", "speculative_greedy_n2", "hf_prompt_lookup"):
            row["identical_to_hf_greedy"] = r["outputs"] == best["hf_greedy"]["outputs"]
        rows[label] = row
    return {"model": name, "heads": heads_label, "stats": bool(table), "n": n, "prompts": prompts, "sampling": sample,
            "hf_sample_penalty": "transformers' logit form (logit / penalty if > 0, else x penalty, before temperature and top-k)",
            "methods": rows}


def pythia70m_shaped() -> MultiTokenModel:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

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
    """Median per-step time of the dynamic proposal (top-k of n heads over a 50k vocabulary, joint
    grid, mask lookup, thresholds, blur + Otsu, penalty, sampling) vs one decoding forward."""
    model = pythia70m_shaped()
    vocab = model.backbone.vocab_size
    caches = model.new_caches()
    model.step(torch.randint(0, vocab, (1, 128)), caches)  # a 128-token context in the cache
    nxt = torch.tensor([[11]])

    def forward_one():
        out = model.step(nxt, caches)
        out.head_log_probs(0, 0)
        caches.crop(1)

    forward = median_ms(forward_one, 30)
    table, stats_dir = None, args.logic_stats or args.pythia_stats
    if stats_dir:
        from multitoken.stats.table import CooccurrenceTable

        table = CooccurrenceTable(stats_dir)  # timing only: any tokenizer will do
        vocab = min(vocab, table.vocab_size)  # candidates must be ids the table knows
    gen = torch.Generator().manual_seed(0)
    seen = np.zeros(vocab, dtype=bool)
    seen[torch.randint(0, vocab, (128,), generator=gen).numpy()] = True
    rng = np.random.default_rng(0)
    out = {"forward_ms_pythia70m_shape_1_token_ctx128": round(forward, 3), "stats_table": stats_dir,
           "stats_distinct": table.meta["distinct"] if table is not None else None}
    for n in (2, 3):
        logps = [torch.log_softmax(torch.randn(vocab, generator=gen) * 3, -1) for _ in range(n)]
        for eps in (0.0, 0.5, 1.0):  # 0: the full order-n grid every step; 0.5: back-offs; 1: order 1 only
            cfg = DecodeConfig(mode="dynamic", top_k=50, eps_b=eps)
            ms = median_ms(lambda: dynamic_propose(logps, cfg, table, seen, rng), args.logic_steps)
            out[f"logic_ms_k50_n{n}_eps{eps}"] = round(ms, 3)
    out["targets_ms"] = {"n2": 1.0, "n3": 3.0}
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    record = {"machine": {"platform": platform.platform(), "threads": args.threads, "cpu_count": torch.get_num_threads(),
                          "loadavg_start": list(__import__("os").getloadavg())},
              "max_new_tokens": args.max_new_tokens, "reps": args.reps}
    if args.logic_only:
        record["logic"] = bench_logic(args)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print("per-step decoding logic (ms):", json.dumps(record["logic"]))
        return record
    emb, emb_heads = load(str(DEFAULT_BASE), args.embedded_heads)
    record["embedded"] = bench_model("stories260K (embedded)", emb, emb_heads, open_table(args.embedded_stats, emb.backbone.tokenizer),
                                     PROMPTS["stories"], args)
    pm, pm_heads = load(args.pythia_mini, args.pythia_heads)
    record["pythia_mini"] = bench_model("pythia-mini", pm, pm_heads, open_table(args.pythia_stats, pm.backbone.tokenizer),
                                        PROMPTS["pile"], args)
    record["logic"] = bench_logic(args)
    record["machine"]["loadavg_end"] = list(__import__("os").getloadavg())
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print_table(record)
    return record


def print_table(record: dict) -> None:
    for key in ("embedded", "pythia_mini"):
        r = record[key]
        print(f"\n{r['model']}  heads: {r['heads']}  stats: {r['stats']}")
        print(f"sampled rows: {r['sampling']}; hf_sample's penalty: {r['hf_sample_penalty']}")
        print(f"{'method':22s} {'tok/s':>8s} {'x HF':>6s} {'x ar_s':>6s} {'tok/fwd':>8s} {'logic ms/fwd':>13s} identical")
        for label, m in r["methods"].items():
            print(f"{label:22s} {m['tokens_per_s']:8.1f} {m['speedup_vs_hf_greedy']:6.2f} {m.get('speedup_vs_ar_sample', float('nan')):6.2f} "
                  f"{m.get('tokens_per_forward', float('nan')):8.2f} {m.get('logic_ms_per_forward', float('nan')):13.3f} "
                  f"{m.get('identical_to_hf_greedy', '')}")
    print("\nper-step decoding logic (ms):", json.dumps(record["logic"]))
    print("load average start/end:", record["machine"]["loadavg_start"], record["machine"]["loadavg_end"])


if __name__ == "__main__":
    main()
