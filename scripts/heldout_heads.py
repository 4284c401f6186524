"""Held-out accuracy of heads dirs side by side, on the same text (the measure shipped heads are
chosen by): the base continues held-out prompts greedily, every heads dir is scored on those
continuations over the whole vocabulary (top-1 / top-5 per head, accuracy per rank).

The held-out prompts are the ones the shipped SmolLM2 heads were always measured on: the first
16 tokens of wikitext-2 *test* sentences (none of that file is training text), 64 new tokens.

    python scripts/heldout_heads.py --base fetched:SmolLM2-135M-Instruct \
        --heads embedded:SmolLM2-135M-Instruct-conditioned /tmp/new/heads-conditioned --out heldout.json
"""

from __future__ import annotations

import argparse
import json

import torch

from multitoken.decoding.trees import MAX_RANKS
from multitoken.embedded import resolve_base
from multitoken.pipeline.eval.benchmark import Bench, add_out, fixture
from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.pipeline.train import recipe_data, recipe_train


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="fetched:SmolLM2-135M-Instruct")
    p.add_argument("--heads", nargs="+", required=True, help="heads dirs (or embedded:NAME)")
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    add_out(p, "heldout.json")
    args = p.parse_args()
    bench = Bench("heldout_heads", args, base=args.base, heads=args.heads, new_tokens=args.new_tokens)
    torch.set_num_threads(args.threads)
    models = [MultiTokenModel.from_pretrained(BackboneConfig(base=args.base, threads=args.threads, cpu_linear="stock"), resolve_base(h))
              for h in args.heads]
    bb = models[0].backbone
    held = recipe_data.sentence_prompts(bb.tokenizer, [fixture("wikitext2_tokens/test.txt")], 16, seed=1)[: args.prompts]
    base = recipe_data.Continuer(bb, "transformers")  # greedy: generate on torch's float32 linears, as ever measured
    parts = [base(held[i:i + args.batch], args.new_tokens, False, [0]) for i in range(0, len(held), args.batch)]
    data = {"ids": torch.cat([a for a, _ in parts]), "valid": torch.cat([b for _, b in parts])}
    rows = {}
    for name, model in zip(args.heads, models):
        acc = recipe_train.rank_accuracy(model.backbone, model, data, 25, "float32", MAX_RANKS)
        rows[name] = acc["summary"]
        print(name, json.dumps(acc["summary"]), flush=True)
    bench.record.update(prompts=len(held), heldout=rows)
    bench.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
