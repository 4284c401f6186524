"""Where the time of one decoding step goes: an ``ar`` step and a speculative step of SmolLM2
(its GGUF's Q4_1 codes read by our CPU kernels), profiled at each thread count asked for.

Per step after the prompt's pass (microseconds; ``pipeline/eval/step_profile.py`` says how each op
is attributed): our kernels' time per format and per linear (the unembedding included, ``lm_head``),
attention, norms, the MLP's activation, residual adds, the step's set-up, the decoding logic
outside the model, and the rest, Python and dispatch between ops; ops and allocating ops per
step. The sum of the attributed parts is the profiled step's wall time, so the residue is shown,
not guessed. The profiler costs time per op: each run's unprofiled wall time per step (best of
``--reps``) stands beside the profiled one.

``--llama-cpp FILE`` attaches llama.cpp's own per-op timings to the record and the page: a JSON
object ``{"source": "how it was measured", "ops": {"op name": microseconds per token, ...}}``
(the side-by-side script writes it; its figures are its own, on its own machine and threads).

The record (``--out``) is the harness's; ``--results FILE`` also writes the tables in the form
``scripts/benchmark_tables.py`` renders (docs/benchmarks/results/profile.json -> profile.md). Run
on a quiet machine:

    python scripts/profile_step.py --threads 1 2 --out profile_step.json --results docs/benchmarks/results/profile.json --overwrite
    python scripts/profile_step.py --smoke --out /tmp/p.json        # a quick check that it runs
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from multitoken.base.atomic import atomic_write_text
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.kernels import cpu_linear
from multitoken.pipeline.eval import step_profile
from multitoken.pipeline.eval.benchmark import Bench, add_out, best_of, check_out
from multitoken.pipeline.sources.assets import default_stats, load_model, load_stats

MODES = ("ar", "speculative")
PROMPT = "The results of the study show that"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "profile_step.json")
    p.add_argument("--base", default="fetched:SmolLM2-135M-Instruct", help="the base (multitoken fetch's name, a dir or a GGUF)")
    p.add_argument("--heads", default=None, help="heads dir (default: the ones the package ships for --base)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per run (greedy, EOS ignored)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads, one profile each")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--cpu-linear", default=cpu_linear.ROWS, choices=cpu_linear.CPU_LINEARS,
                   help="the CPU linears (rows-q8: int8 activations, docs/kernels.md)")
    p.add_argument("--reps", type=int, default=3, help="unprofiled timed runs per cell (the fastest kept)")
    p.add_argument("--smoke", action="store_true", help="tiny settings (8 tokens, 1 rep): does it run")
    p.add_argument("--llama-cpp", default=None, help="JSON of llama.cpp's per-op timings to attach (see above)")
    p.add_argument("--results", default=None, help="also write the tables for docs/benchmarks (benchmark_tables.py's form)")
    args = p.parse_args(argv)
    if args.smoke:
        args.max_new_tokens, args.reps = 8, 1
    if args.max_new_tokens < 2 or args.reps < 1 or min(args.threads) < 1:
        p.error("--max-new-tokens must be >= 2, --reps >= 1 and every --threads >= 1")
    return args


def llama_cpp(path: str | None) -> dict | None:
    """llama.cpp's per-op timings from ``path`` (None: not given), or a one-line error."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: --llama-cpp {path}: cannot read it as JSON ({err}); pass the side-by-side script's file")
    ops = data.get("ops") if isinstance(data, dict) else None
    if not isinstance(ops, dict) or not all(isinstance(v, (int, float)) for v in ops.values()):
        raise SystemExit(f"error: --llama-cpp {path}: needs an object with \"ops\": {{op name: microseconds per token}}")
    return data


def config(mode: str, tokens: int) -> DecodeConfig:
    return DecodeConfig(mode=mode, greedy=True, max_new_tokens=tokens, stop_at_eos=False)


def run_cell(model, ids, table, mode: str, threads: int, args) -> dict:
    """One mode at one thread count: unprofiled runs (the best kept), then one profiled run."""
    torch.set_num_threads(threads)
    cfg = config(mode, args.max_new_tokens)
    best = best_of({mode: lambda: {"trace": generate(model, ids, cfg, table=table).trace}}, args.reps)[mode]
    found, result = step_profile.profile_run(model, ids, cfg, table, step_profile.draft_unembeddings(model))
    found["measured_us"] = step_profile.measured_us(best["trace"])
    found["tokens_per_s_unprofiled"] = round(best["trace"].tokens_per_s, 2)
    found["threads"], found["mode"], found["token_ids"] = torch.get_num_threads(), mode, result.token_ids
    return found


def label(cell: dict) -> str:
    return f"{cell['mode']}, {cell['threads']} thread{'s' if cell['threads'] > 1 else ''}"


def tables(record: dict, cells: list[dict], lcpp: dict | None, source: str) -> list[dict]:
    """The page's tables: the step by part, our kernels by linear, llama.cpp's ops (if given)."""
    m = record["machine"]
    common = {"machine": f"{m['cpu']}, {m['cores']} cores ({', '.join(m['cpu_flags'])})",
              "date": time.strftime("%Y-%m-%d"), "command": record["command"], "source": source}
    load = f"Load average before / after: {record['load_before']} / {record.get('load_after')}."
    heads = [label(c) for c in cells]
    parts = list(dict.fromkeys(k for c in cells for k in c["parts_us"]))
    rows = [[part, *(c["parts_us"].get(part, 0.0) for c in cells)] for part in parts]
    rows += [["**profiled step (sum of the above)**", *(c["wall_us"] for c in cells)],
             ["unprofiled step (best run)", *(c["measured_us"] for c in cells)],
             ["unprofiled step less the profiled ops (Python, dispatch)", *(round(c["measured_us"] - c["ops_us"], 1) for c in cells)],
             ["tokens per forward", *(c["tokens_per_forward"] for c in cells)],
             ["ops per step (top level / all)", *(f"{c['top_level_ops_per_step']} / {c['ops_per_step']}" for c in cells)],
             ["allocating ops per step (KiB)", *(f"{c['allocating_ops_per_step']} ({c['allocated_kb_per_step']})" for c in cells)]]
    out = [{"id": "profile-step", **common, "columns": ["part (us per step)", *heads], "rows": rows,
            "note": f"Greedy, {record['settings']['max_new_tokens']} new tokens. {load}"}]
    names = list(dict.fromkeys(f"{n} ({f})" for c in cells for n, by in c["kernels_by_linear_us"].items() for f in by))
    kernel = lambda c, key: next((v for n, by in c["kernels_by_linear_us"].items() for f, v in by.items() if f"{n} ({f})" == key), 0.0)
    out.append({"id": "profile-kernels", **common, "columns": ["linear (format), kernel us per step", *heads],
                "rows": [[n, *(kernel(c, n) for c in cells)] for n in names], "note": load})
    if lcpp is not None:
        out.append({"id": "profile-llama-cpp", **common, "source": str(lcpp.get("source", source)),
                    "columns": ["llama.cpp op", "us per token"], "rows": [[k, v] for k, v in lcpp["ops"].items()]})
    return out


def print_table(cells: list[dict]) -> None:
    parts = list(dict.fromkeys(k for c in cells for k in c["parts_us"]))
    print(f"\n{'part (us per step)':52s}" + "".join(f"{label(c):>22s}" for c in cells))
    for part in parts:
        print(f"{part:52s}" + "".join(f"{c['parts_us'].get(part, 0.0):22.1f}" for c in cells))
    for key, name in (("wall_us", "profiled step"), ("measured_us", "unprofiled step"), ("tokens_per_forward", "tokens per forward")):
        print(f"{name:52s}" + "".join(f"{c[key]:22}" for c in cells))


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = check_out(args.results, args.overwrite)
    lcpp = llama_cpp(args.llama_cpp)
    bench = Bench("profile_step", args, base=args.base, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                  threads=args.threads, modes=args.modes, reps=args.reps, cpu_linear=args.cpu_linear)
    model, heads = load_model(args.heads, args.base, cpu_linear=args.cpu_linear)
    model.prepare_linears()  # as decoding would at its first run: the formats are known from here
    table = load_stats(default_stats(model.backbone), model.backbone.tokenizer)
    ids = model.backbone.tokenizer(args.prompt, return_tensors="pt").input_ids
    bench["heads"], bench["formats"] = heads, step_profile.formats(model)
    cells = [run_cell(model, ids, table, mode, threads, args) for threads in args.threads for mode in args.modes]
    bench["same_tokens"] = len({tuple(c.pop("token_ids")) for c in cells}) == 1  # greedy: every cell's text alike
    bench["profiles"], bench["llama_cpp"] = {label(c): c for c in cells}, lcpp
    record = bench.save()
    record["tables"] = tables(record, cells, lcpp, args.out or "profile_step.py")
    record = bench.save()
    if results is not None:
        atomic_write_text(results, json.dumps({"tables": record["tables"]}, indent=2) + "\n")
    print_table(cells)
    print(f"same greedy tokens in every cell: {record['same_tokens']}; load average before / after "
          f"{record['load_before']} / {record['load_after']}")
    return record


if __name__ == "__main__":
    main()
