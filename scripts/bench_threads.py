"""Which torch thread count is fastest, per kind of work: one sequence (``generate``) and
batches (``train`` steps). Sets the defaults in ``base/threads.py``.

For each thread count (1, 2 and torch's default by default) it measures
- generate, batch 1, greedy: tokens/s of ``ar`` and ``speculative`` (the CLI's default mode) on
  the embedded stories260K with its heads and stats, and of ``ar`` on pythia-mini (base only);
- train: tokens/s of heads-only training steps (3 replicated heads, AdamW) on both models.
Repetitions run the thread counts interleaved and the best repetition counts; the 1-minute load
average is recorded after every kept measurement, since other processes on the machine skew
every figure (run it on a quiet machine). Prints a table and writes the harness's JSON record.

    python scripts/bench_threads.py --out bench_threads.json
    python scripts/bench_threads.py --new-tokens 8 --train-steps 1 --reps 1 --seq-len 32 --out /tmp/t.json   # smoke run
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.pipeline.sources.assets import load_stats
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.embedded import DEFAULT_BASE, EMBEDDED_HEADS, EMBEDDED_STATS
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.base.threads import THREADS_BATCHES, THREADS_ONE_SEQUENCE, set_threads
from multitoken.pipeline.eval.benchmark import FIXTURES, Bench, add_out, best_of, load_average
from multitoken.pipeline.train import optim
from multitoken.pipeline.train.train import Dist, Runner, train_step
from multitoken.pipeline.train.trainer_config import TrainConfig

PROMPTS = {"stories260K": "Once upon a time", "pythia-mini": "The results of the study show that"}
TORCH_DEFAULT = torch.get_num_threads()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "bench_threads.json")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 0], help="thread counts (0: torch's default)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per generate call")
    p.add_argument("--reps", type=int, default=3, help="repetitions (the best counts)")
    p.add_argument("--train-steps", type=int, default=5, help="timed training steps per measurement (after one warm-up step)")
    p.add_argument("--batch-size", type=int, default=8, help="train: sequences per step (multitoken train's default)")
    p.add_argument("--seq-len", type=int, default=256, help="train: tokens per sequence (multitoken train's default)")
    p.add_argument("--pythia-mini", default=str(FIXTURES / "pythia-mini"))
    return p.parse_args(argv)


def load_models(args) -> dict:
    """name -> (model for generate, heads-only training model, stats table or None)."""
    models = {}
    emb_bb = load_backbone(BackboneConfig(base=str(DEFAULT_BASE), threads=0))
    emb = MultiTokenModel.from_pretrained(emb_bb, EMBEDDED_HEADS)
    models["stories260K"] = (emb, _trainable(load_backbone(BackboneConfig(base=str(DEFAULT_BASE), threads=0))),
                             load_stats(str(EMBEDDED_STATS), emb_bb.tokenizer))
    if Path(args.pythia_mini).is_dir():
        pm_bb = load_backbone(BackboneConfig(base=args.pythia_mini, threads=0))
        base_only = MultiTokenModel.attach(pm_bb, {"head_type": "medusa", "n_future": 1})
        models["pythia-mini"] = (base_only, _trainable(load_backbone(BackboneConfig(base=args.pythia_mini, threads=0))), None)
    else:
        print(f"pythia-mini not found at {args.pythia_mini}: measuring the embedded model only")
    return models


def _trainable(backbone) -> MultiTokenModel:
    torch.manual_seed(0)
    return MultiTokenModel.attach(backbone, {"head_type": "replicated", "n_future": 3})


def time_generate(model, table, prompt: str, mode: str, new_tokens: int) -> dict:
    ids = model.backbone.tokenizer(prompt, return_tensors="pt").input_ids
    cfg = DecodeConfig(mode=mode, greedy=True, max_new_tokens=new_tokens, stop_at_eos=False)
    generate(model, ids, DecodeConfig(mode=mode, greedy=True, max_new_tokens=4, stop_at_eos=False), table=table)  # warm-up
    start = time.perf_counter()
    out = generate(model, ids, cfg, table=table)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": len(out.token_ids) / seconds, "tokens": len(out.token_ids), "seconds": seconds}


def time_train(model, args) -> dict:
    """``multitoken train``'s own step (heads mode, its default settings) on random ids."""
    cfg = TrainConfig(heads="-", out="-", batch_size=args.batch_size, seq_len=args.seq_len)
    for p in model.base_head_parameters():  # as train() does: head 1 stays the base model
        p.requires_grad_(False)
    opt = torch.optim.AdamW(optim.param_groups(model, cfg), lr=cfg.lr, weight_decay=cfg.weight_decay)
    runner = Runner(model, Dist())
    rows = np.random.default_rng(0).integers(0, model.backbone.vocab_size, (args.batch_size, args.seq_len))  # [B, T]
    model.train(True)
    train_step(runner, opt, rows, cfg, 0)  # warm-up
    start = time.perf_counter()
    for step in range(1, args.train_steps + 1):
        train_step(runner, opt, rows, cfg, step)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": args.batch_size * args.seq_len * args.train_steps / seconds, "seconds": seconds}


def measure(models: dict, args) -> dict:
    """(model | work) -> threads -> the best repetition's record: every cell once per repetition,
    thread counts interleaved; each cell's own warm-up call is off its clock (``seconds``)."""
    runs = {}
    for threads in args.threads:
        for name, (gen_model, train_model, table) in models.items():
            modes = ["ar", "speculative"] if gen_model.n_future > 1 else ["ar"]
            for m in modes:
                runs[threads, name, f"generate {m}"] = (lambda g, t, p, m: lambda: time_generate(g, t, p, m, args.new_tokens))(
                    gen_model, table, PROMPTS[name], m)
            runs[threads, name, "train step"] = (lambda t: lambda: time_train(t, args))(train_model)
    best = best_of(runs, args.reps, warm_up=False, before=lambda key: set_threads(key[0]),
                   after=lambda: {"threads_used": torch.get_num_threads(), "load_after": load_average()[:1]},
                   score=lambda r: r["seconds"])
    table: dict = {}
    for (threads, name, work), r in best.items():
        table.setdefault(f"{name} | {work}", {})[threads] = r
    return table


def print_table(summary: dict, threads: list[int]) -> None:
    label = {t: (f"{t} thread{'s' if t != 1 else ''}" if t else f"default ({TORCH_DEFAULT})") for t in threads}
    print(f"\n{'model | work':36s}" + "".join(f"{label[t]:>14s}" for t in threads) + "   fastest")
    for key, cell in summary.items():
        fastest = max(cell, key=lambda t: cell[t]["tokens_per_s"])
        print(f"{key:36s}" + "".join(f"{cell[t]['tokens_per_s']:14.1f}" for t in threads) + f"   {label[fastest]}")
    print("(tokens/s, best repetition)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    bench = Bench("threads", args, torch_default_threads=TORCH_DEFAULT, reps=args.reps, new_tokens=args.new_tokens,
                  train_steps=args.train_steps, batch_size=args.batch_size, seq_len=args.seq_len)
    bench["current_defaults"] = {"one_sequence": THREADS_ONE_SEQUENCE, "batches": THREADS_BATCHES}
    summary = measure(load_models(args), args)
    bench["best"] = {key: {str(t): r for t, r in cell.items()} for key, cell in summary.items()}
    record = bench.save()
    print_table(summary, args.threads)
    print(f"load average before / after {record['load_before']} / {record['load_after']}")
    return record


if __name__ == "__main__":
    main()
