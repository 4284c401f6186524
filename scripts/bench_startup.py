"""Start-up of ``multitoken generate``: a fresh process from launch to the first decoded token.

Each run is a new Python process running the CLI (``generate PROMPT --json --max-new-tokens 1``),
so imports count as a user meets them. Per model two runs: ``first``, with no packed weights on
disk (the first run after a fetch: the linears are packed and written to the cache), and
``later``, which reads them back (kernels/pack_cache.py). The packed cache is a temporary one
(``MULTITOKEN_CACHE`` of the child: its ``models`` and ``kernels`` are links to the real cache's,
so the fetched model and the compiled kernel are reused and the user's cache is not touched).

What a run records (seconds since the child's interpreter ran its first line):
- ``imports_s``: the command's modules and torch imported (its "loading" stage starts);
- ``ready_s``: ready to decode (the model loaded, its linears packed, caches made);
- ``first_token_s``: the first token decoded (ready plus the prompt's pass);
- ``prepare_s``: of ``ready_s``, the linears' packing (or reading back) and the caches;
- ``process_s``: the whole process as the parent saw it (interpreter start and exit included).

    python scripts/bench_startup.py --reps 3 --out startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from multitoken.embedded import cache_dir
from multitoken.pipeline.eval.benchmark import Bench, add_out, best_of
from multitoken.pipeline.sources.fetch import fetched, known

# The child: the CLI as installed, with each status stage time-stamped (base/progress.status is
# replaced before any module binds it) and the time main() returned.
DRIVER = """
import json, sys, time
t0 = time.perf_counter()
import multitoken.base.progress as progress
stages = []
progress.status = lambda text: stages.append([time.perf_counter() - t0, text])
from multitoken.pipeline.cli import main
code = main()  # as the installed command calls it: the process is the command's (base/collector.py)
print("STARTUP " + json.dumps({"code": code, "end_s": time.perf_counter() - t0, "stages": stages}), file=sys.stderr)
sys.exit(code)
"""
MODELS = {"embedded": [], "smollm2": ["--base", "fetched:SmolLM2-135M-Instruct"]}


def _cache(root: Path) -> dict:
    """The child's environment: a cache in ``root`` whose models and kernels are the real ones."""
    real = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    for name in ("models", "kernels"):
        (real / name).mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(real / name, target_is_directory=True)
    return {**os.environ, "MULTITOKEN_CACHE": str(root)}


def _run(argv: list[str], env: dict) -> dict:
    """One child process -> its phases (module doc)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", DRIVER, *argv], capture_output=True, text=True, env=env, timeout=900)
    process_s = time.perf_counter() - start
    lines = [line for line in done.stderr.splitlines() if line.startswith("STARTUP ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"error: {' '.join(argv)} failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    timing, trace = json.loads(lines[-1][len("STARTUP "):]), json.loads(done.stdout)["trace"]
    loading = [t for t, text in timing["stages"] if text.startswith("loading ")]
    ready = timing["end_s"] - trace["wall_s"]  # decoding's wall time starts when it is ready
    return {"process_s": process_s, "imports_s": loading[0] if loading else None, "ready_s": ready,
            "first_token_s": ready + trace["prefill_s"], "prepare_s": trace["prepare_s"],
            "stages": [[round(t, 3), text] for t, text in timing["stages"]]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "startup.json")
    p.add_argument("--reps", type=int, default=3, help="timed runs of each (after one untimed run of each)")
    p.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS),
                   help="smollm2 needs `multitoken fetch smollm2` first (skipped, said, where it is not fetched)")
    p.add_argument("--prompt", default="Once upon a time")
    args = p.parse_args(argv)
    models = [m for m in args.models if m != "smollm2" or fetched(known("smollm2")) is not None]
    if len(models) < len(args.models):
        print("smollm2 is not fetched: skipped (run multitoken fetch smollm2)", file=sys.stderr)
    bench = Bench("startup", args, reps=args.reps, models=models, prompt=args.prompt)
    with tempfile.TemporaryDirectory(prefix="multitoken-startup-") as tmp:
        root = Path(tmp)
        env = _cache(root)
        cli = ["generate", args.prompt, "--json", "--max-new-tokens", "1", "--threads", "1"]
        runs = {f"{m}/{when}": (lambda m=m: _run([*cli, *MODELS[m]], env)) for m in models for when in ("first", "later")}

        def before(label: str) -> None:
            if label.endswith("/first"):
                shutil.rmtree(root / "packed", ignore_errors=True)  # as after a fetch: nothing packed yet

        best = best_of(runs, args.reps, before=before, score=lambda r: r["ready_s"])
    bench["runs"] = best
    print(f"{'run':<18}{'imports':>9}{'ready':>9}{'1st token':>11}{'packing':>9}{'process':>9}  (s)")
    for label, r in best.items():
        print(f"{label:<18}{r['imports_s'] or float('nan'):>9.2f}{r['ready_s']:>9.2f}{r['first_token_s']:>11.2f}"
              f"{r['prepare_s']:>9.2f}{r['process_s']:>9.2f}")
    return bench.save()


if __name__ == "__main__":
    main()
