"""The batched KV-cache layout decision, by counting slots, not timing them.

Batched speculative / dynamic rows forget different numbers of slots per step. Two layouts:
masked holes (``pipeline/runtime/ragged.py``: the common suffix cropped, the rest masked, a gather
only past 1.5x the longest row) or compaction every step (each row's tokens gathered contiguous
after every verification). Attention reads every slot of the axis each step, and a compaction
reads and writes every slot once, so the comparison is in slots: slot reads of the masked axis
against those of a compact axis, plus the slots a per-step compaction copies. Runs on the
embedded model with its heads and stats, 8 prompts of different lengths, 128 new tokens.

    python scripts/bench_cache_layout.py --out cache_layout.json
"""

from __future__ import annotations

import argparse

import torch

from multitoken.decoding.engine import generate_batch
from multitoken.decoding.config import DecodeConfig
from multitoken.embedded import DEFAULT_BASE, EMBEDDED_HEADS, EMBEDDED_STATS
from multitoken.pipeline.model import model as model_module
from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.pipeline.eval.benchmark import Bench, add_out
from multitoken.stats.table import CooccurrenceTable

TEXTS = ["Once upon a time", "The little dog ran to the park and", "Lily and Ben were playing with a ball. Then", "She"]
MODES = {"speculative_greedy": dict(mode="speculative", greedy=True), "typical_greedy": dict(mode="typical", greedy=True),
         "dynamic_eps0.5": dict(mode="dynamic", eps_b=0.5)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "cache_layout.json")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    bench = Bench("cache_layout", args, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    torch.set_num_threads(1)
    model = MultiTokenModel.from_pretrained(BackboneConfig(base=str(DEFAULT_BASE)), EMBEDDED_HEADS)
    tok = model.backbone.tokenizer
    table = CooccurrenceTable.for_tokenizer(str(EMBEDDED_STATS), tok)
    texts = [TEXTS[i % 4] + " " + " ".join(TEXTS[: i // 4]) for i in range(args.batch_size)]
    ids = [tok(t)["input_ids"] for t in texts]
    plain, record = model_module.step, bench.record.setdefault("modes", {})
    for label, mode in MODES.items():
        log = []

        def step(m, new_ids, caches, *a, **k):
            out = plain(m, new_ids, caches, *a, **k)
            lengths = caches.row_lengths(new_ids.shape[0])
            log.append((new_ids.shape[0], caches.length, max(lengths), sum(lengths)))
            return out

        model_module.step = step
        try:
            generate_batch(model, ids, DecodeConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=False, **mode), table=table)
        finally:
            model_module.step = plain
        masked = sum(b * s for b, s, _, _ in log)
        compact = sum(b * longest for b, _, longest, _ in log)
        record[label] = {"steps": len(log), "slot_reads_masked": masked, "slot_reads_compact": compact,
                         "slots_copied_compacting_every_step": sum(b * longest for b, _, longest, _ in log[1:]),
                         "real_token_slots": sum(t for *_, t in log), "masked_over_compact": round(masked / compact, 4),
                         "max_slots": max(s for _, s, _, _ in log), "longest_row": max(longest for *_, longest, _ in log)}
        print(label, record[label])
    return bench.save()


if __name__ == "__main__":
    main()
