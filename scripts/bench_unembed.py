"""The multi-row unembedding cliff: ms per call of logits for R rows against a [V, H] weight,
three ways -- F.linear over all R rows, F.linear in calls of at most 3 rows, and (W @ x^T)^T --
on pythia-160m / 410m shapes (random fp32 weights: cost only). Decoding no longer relies on a
fixed rule: pipeline/model/unembed_plan.py measures the same forms per backbone, dtype and thread
count when a row count is first needed (bench_decode.py records that plan). Run on a quiet machine:

    python scripts/bench_unembed.py --threads 1 --out bench_unembed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"pythia-160m": (50304, 768), "pythia-410m": (50304, 1024)}


def per_call_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rows", default="1,2,3,4,5,6,9")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = {"machine": {"platform": platform.platform(), "threads": args.threads, "loadavg_start": list(os.getloadavg()),
                          "torch": torch.__version__}, "results": {}}
    for shape in args.shapes.split(","):
        v, h = SHAPES[shape]
        w = torch.randn(v, h) * 0.02
        rows_out = {}
        for r in map(int, args.rows.split(",")):
            x = torch.randn(r, h)
            rows_out[r] = {
                "linear": per_call_ms(lambda: F.linear(x, w), args.reps),
                "linear_3row_calls": per_call_ms(lambda: [F.linear(c, w) for c in x.split(3)], args.reps),
                "transposed": per_call_ms(lambda: (w @ x.T).T, args.reps),
            }
            print(f"{shape:12s} rows {r}: " + "  ".join(f"{k} {ms:7.2f} ms" for k, ms in rows_out[r].items()), flush=True)
        record["results"][shape] = rows_out
    record["machine"]["loadavg_end"] = list(os.getloadavg())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return record


if __name__ == "__main__":
    main()
