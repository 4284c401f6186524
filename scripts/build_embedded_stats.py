"""Build the embedded stats dir shipped beside the embedded stories260K model.

Samples a corpus from the model itself (plain sampling: temperature 1, no top-k/top-p, from
the BOS token, one document per sample, cut at EOS or at a new BOS) with transformers' ``generate``, writes
it as a jsonl of token ids, then counts it with ``multitoken stats build`` (orders 1-3,
pruned by --min-count so the shipped dir stays small). Prints and writes a JSON record.

    .venv/bin/python scripts/build_embedded_stats.py --tokens 1000000
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from multitoken.base.tokenizer import load_tokenizer
from multitoken.base.atomic import atomic_write_text
from multitoken.base.data import DataConfig
from multitoken.embedded import DEFAULT_BASE, EMBEDDED_DIR
from multitoken.stats.job import BuildConfig, build
from multitoken.base.quiet import quiet_dependencies

quiet_dependencies()  # dependencies' progress bars and notices off, as in the CLI


def sample_corpus(path: Path, tokens: int, batch: int, max_new: int, seed: int) -> dict:
    """Sample documents until ``tokens`` tokens are written to ``path`` (jsonl of input_ids)."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # a 260K-parameter model: more threads only add contention
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_BASE).eval()
    bos, eos = model.config.bos_token_id, model.config.eos_token_id
    written, docs, t0 = 0, 0, time.perf_counter()
    with open(path, "w") as fh, torch.inference_mode():
        while written < tokens:
            prompt = torch.full((batch, 1), bos, dtype=torch.long)
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=max_new, pad_token_id=eos, eos_token_id=eos)
            for row in out[:, 1:].tolist():  # drop the BOS prompt
                # a story ends at EOS or, as in llama2.c's training data, where the next BOS starts one
                ends = [row.index(t) for t in (bos, eos) if t in row]
                ids = row[:min(ends)] if ends else row
                fh.write(json.dumps({"input_ids": ids}) + "\n")
                written += len(ids)
                docs += 1
            print(f"\rsampled {written:,} tokens", end="", file=sys.stderr)
    print(file=sys.stderr)
    return {"tokens": written, "documents": docs, "seconds": round(time.perf_counter() - t0, 1)}


def relabel(out: Path) -> dict:
    """Replace this machine's temp paths in meta.json by names valid wherever the package is
    (the tokenizer is already recorded as embedded:stories260K by the job)."""
    meta = json.loads((out / "meta.json").read_text())
    source = "samples of the embedded stories260K model (scripts/build_embedded_stats.py)"
    meta["source"]["data"] = meta["job"]["data"]["data"] = source
    atomic_write_text(out / "meta.json", json.dumps(meta, indent=1) + "\n")
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1_000_000, help="tokens to sample")
    ap.add_argument("--batch", type=int, default=256, help="samples generated in parallel")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="longest sample")
    ap.add_argument("--min-count", type=int, nargs="+", default=[2], help="pruning, as for stats build")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(EMBEDDED_DIR / "stories260K-stats"), help="stats dir to write (replaced)")
    ap.add_argument("--json", default=None, help="also write the record here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="embedded-stats-"))
    try:
        corpus = work / "samples.jsonl"
        record = {"sampling": sample_corpus(corpus, args.tokens, args.batch, args.max_new_tokens, args.seed)}
        stage = work / "stats"
        cfg = BuildConfig(out=str(stage), tokenizer=str(DEFAULT_BASE), order=3, min_count=tuple(args.min_count))
        build(cfg, DataConfig(data=str(corpus)))
        (stage / "config.json").unlink(missing_ok=True)  # paths of this machine's temp dir: not worth shipping
        out = Path(args.out)
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(stage, out)
        meta = relabel(out)
        record.update({"out": str(out), "distinct": meta["distinct"], "min_counts": meta["min_counts"],
                       "bytes": sum(f.stat().st_size for f in out.iterdir()),
                       "args": vars(args), "tokenizer_fingerprint": meta["tokenizer"]["fingerprint"]})
        assert load_tokenizer(str(DEFAULT_BASE)) is not None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(record, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
