"""The heads recipe's throughput, old recipe against new, paired on the same text (prints and writes JSON).

Each repetition runs ``multitoken build-heads`` once per recipe, interleaved (old, new, old, new,
...) so that a load spike hits both, each into a fresh folder, on the same ``--data`` /
``--heldout`` text and settings; every run is a child process whose build report gives:

- distillation: new tokens per second (wall and process CPU time) over the training shards;
- training: tokens per second the heads' steps process (wall and CPU), and its arithmetic;
- held-out accuracy of every head type (top-1 / top-5 per head, measured in float32 either way),
  on held-out continuations that are greedy, so the same text for both recipes.

``old`` is by default this checkout with the first recipe's choices (``OLD_FLAGS``: transformers'
``generate`` in float32, 64 rows per batch, float32 training); ``new`` takes build-heads' own
defaults unless a flag below is given. ``--old-multitoken`` runs another checkout's command
instead (pass its flags with ``--old-flags``: an older checkout lacks ``--distill-dtype``), e.g. a
worktree of the commit before the change. The
record keeps every run, the load average around each, the medians and the new / old ratios.
On a shared machine compare the CPU-time rates (``cpu_*``); the wall clock measures neighbours.

    python scripts/bench_build.py --base fetched:SmolLM2-135M-Instruct --heads eagle3 --tokens 8192 \\
        --out bench_build.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from multitoken.pipeline.eval.benchmark import Bench, add_out, fixture, load_average

OLD_FLAGS = "--distill-engine transformers --distill-dtype float32 --distill-batch 64 --compute-dtype float32"
RATES = ("distill_tokens_per_s", "distill_cpu_tokens_per_s", "train_tokens_per_s", "train_cpu_tokens_per_s")


def arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="fetched:SmolLM2-135M-Instruct", help="the base (as build-heads' --base)")
    p.add_argument("--data", nargs="+", default=None, help="training text (default: the wikitext-2 valid fixture)")
    p.add_argument("--heldout", nargs="+", default=None, help="held-out text (default: the wikitext-2 test fixture)")
    p.add_argument("--heads", nargs="+", default=["eagle3"], help="head types trained")
    p.add_argument("--tokens", type=int, default=8192, help="new tokens distilled for training")
    p.add_argument("--heldout-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--distill-batch", type=int, default=None, help="rows continued at once (default: build-heads' own; "
                   "the old recipe's flags set 64)")
    p.add_argument("--batch-rows", type=int, default=16)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of every run")
    p.add_argument("--reps", type=int, default=1, help="paired repetitions (old then new each time)")
    p.add_argument("--old-multitoken", default=None, help="the old recipe's command (default: this checkout's)")
    p.add_argument("--old-flags", default=OLD_FLAGS, help="flags the old recipe's runs add")
    p.add_argument("--new-flags", default="", help="flags the new recipe's runs add")
    p.add_argument("--work", default=None, help="folder for the builds (default: a temporary one, removed)")
    add_out(p, None)
    return p.parse_args(argv)


def build_args(args, out: Path) -> list[str]:
    data = args.data or [str(fixture("wikitext2_tokens") / "valid.txt")]
    held = args.heldout or [str(fixture("wikitext2_tokens") / "test.txt")]
    return ["build-heads", "--base", args.base, "--data", *data, "--heldout", *held, "--heads", *args.heads,
            "--tokens", str(args.tokens), "--heldout-prompts", str(args.heldout_prompts), "--new-tokens", str(args.new_tokens),
            "--batch-rows", str(args.batch_rows), "--epochs", str(args.epochs), "--threads", str(args.threads), "--out", str(out),
            *(["--distill-batch", str(args.distill_batch)] if args.distill_batch else [])]


def run_build(command: list[str], args, out: Path, flags: str) -> dict:
    """One build in a child process -> its figures from the build report, the load around it."""
    before = load_average()
    done = subprocess.run([*command, *build_args(args, out), *shlex.split(flags)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: the build failed ({' '.join(command)} {flags}):\n{done.stderr[-3000:]}")
    return figures(json.loads((out / "report" / "build_report.json").read_text()), before, load_average())


def figures(report: dict, before: list, after: list) -> dict:
    """Tokens per second of distillation and training (wall and CPU) and held-out accuracy."""
    distill, train = report["stages"]["distill"]["train"], report["stages"]["train"]
    new = distill["new_tokens_this_run"]
    out = {"distill_new_tokens": new, "distill_s": distill["seconds"], "distill_cpu_s": distill.get("cpu_seconds"),
           "train_tokens": train["tokens_seen"], "train_steps": train["steps"], "train_s": train["seconds"],
           "train_cpu_s": train.get("cpu_seconds"), "compute_dtype": train.get("compute_dtype", "float32"),
           "engine": distill.get("engine", "transformers"), "distill_dtype": distill.get("dtype", "float32"),
           "heldout": report["heldout"], "load_before": before, "load_after": after}
    for kind, tokens, key in (("distill", new, "distill"), ("train", train["tokens_seen"], "train")):
        out[f"{kind}_tokens_per_s"] = round(tokens / max(out[f"{key}_s"], 1e-9), 1)
        cpu = out[f"{key}_cpu_s"]
        out[f"{kind}_cpu_tokens_per_s"] = round(tokens / max(cpu, 1e-9), 1) if cpu is not None else None
    return out


def summary(runs: dict[str, list[dict]]) -> dict:
    """Each recipe's median rates and held-out accuracy (of its first run), and the new / old ratios."""
    med = {name: {k: statistics.median(r[k] for r in rs) if all(r[k] is not None for r in rs) else None for k in RATES}
           for name, rs in runs.items()}
    ratios = {k: round(med["new"][k] / med["old"][k], 2) for k in RATES if med["old"][k] and med["new"][k]}
    return {"median": med, "new_over_old": ratios, "heldout": {name: rs[0]["heldout"] for name, rs in runs.items()}}


def table(runs: dict[str, list[dict]], heads: list[str]) -> dict:
    """The figures as a docs table's columns and rows (docs/benchmarks/results format)."""
    med = summary(runs)["median"]
    columns = ["recipe", "distillation", "distill tok/s (CPU)", "train tok/s (CPU)", "train dtype",
               *[f"{k} t+2 / t+3 top-1" for k in heads]]
    rows = []
    for name, rs in runs.items():
        held = rs[0]["heldout"]
        rows.append([name, f"{rs[0]['engine']}, {rs[0]['distill_dtype']}", med[name]["distill_cpu_tokens_per_s"],
                     med[name]["train_cpu_tokens_per_s"], rs[0]["compute_dtype"], *[f"{held[k]['head2/top1']:.3f} / {held[k]['head3/top1']:.3f}" for k in heads]])
    return {"columns": columns, "rows": rows}


def main(argv=None) -> int:
    args = arguments(argv)
    bench = Bench("build", args, **{k: v for k, v in vars(args).items() if k not in ("out", "overwrite")})
    ours = [sys.executable, "-m", "multitoken.pipeline.cli"]
    commands = {"old": shlex.split(args.old_multitoken) if args.old_multitoken else ours, "new": ours}
    flags = {"old": args.old_flags, "new": args.new_flags}
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        for rep in range(args.reps):
            for name in ("old", "new"):
                got = run_build(commands[name], args, Path(work) / f"{name}-{rep}", flags[name])
                runs[name].append(got)
                print(name, {k: got[k] for k in (*RATES, "compute_dtype", "engine", "distill_dtype")}, flush=True)
                bench["runs"] = runs
                bench.save()  # a long run stopped keeps what it measured
    bench["summary"] = summary(runs)
    bench["table"] = table(runs, args.heads)
    bench.save()
    print(json.dumps(bench["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
