"""Our engine side by side with llama.cpp, the engine CPU users pick, on the same GGUF.

llama.cpp's tools are built once from the source the registry's ``llama-cpp-python`` sdist
vendors (``make llama-cpp-source`` downloads it) into the cache, keyed by that source and the
CPU's flags (``multitoken.pipeline.integrations.llama_cpp``; the build time is recorded). Then,
on SmolLM2-135M-Instruct's Q4_1 GGUF, greedy, at each ``--threads`` count, every prompt through:

- llama.cpp: ``plain`` (llama-completion), ``lookup`` (llama-lookup, n-gram drafts) and, with an
  EAGLE-3 drafter, ``eagle3`` (llama-speculative-simple ``--spec-type draft-eagle3``);
- ours (``multitoken generate --prompts``, one process per method, a warm-up prompt first):
  ``ar``, ``speculative`` (the shipped drafting heads), ``lookup`` (the same with ``--lookup``)
  and, with a drafter, ``eagle3`` (its heads, ``--drafter eagle3``); each again with ``-q8``,
  on ``--cpu-linear rows-q8`` (Q4_1 / Q8_0 codes read against int8 activations, as llama.cpp reads them).

The drafter is ``--drafter DIR`` (eagle3 heads), else the one the package ships for SmolLM2
where it exists; it is exported (``multitoken export --format eagle3``) and converted by
llama.cpp's own ``convert_hf_to_gguf.py --target-model-dir BASE``.

Speeds leave out start-up and the prompt: llama.cpp's tools print their decoding time; ours is
the trace's time after the prompt's pass (``decode_rate``). Every speculative run's text must
be its engine's plain greedy text on the same linear setting (recorded per prompt; llama.cpp's speculative tools may run a
few tokens past ``-n``, so theirs must begin with all of it). Ratios are paired per prompt against
llama.cpp plain at the same thread count; the table gives their medians.

Prompts (default): the first 16 tokens of held-out wikitext-2 *test* sentences (the set the
shipped heads are measured on, ``heldout_heads.py``; none of that file is training text),
shuffled with seed 1, the first ``--num-prompts``.

    make bench-llama-cpp                                   # the full table (6 prompts, 128 tokens, 1 and 2 threads)
    python scripts/bench_llama_cpp.py --drafter DIR --out llama_cpp.json
    python scripts/bench_llama_cpp.py --smoke --drafter DIR    # 1 prompt, 16 tokens, 1 thread: it runs end to end
    python scripts/bench_llama_cpp.py --isa avx2 --out llama_cpp_avx2.json  # both engines at the AVX2 level

``--isa avx2`` runs an AVX2 CPU's code on a bigger one: llama.cpp built at ggml's AVX2 level
(``-DGGML_NATIVE=OFF``: AVX2, FMA, F16C, no AVX512) and ours with ``MULTITOKEN_CPU_FEATURES=avx2``
(our kernels' AVX2 build) and ``ATEN_CPU_CAPABILITY=avx2`` (torch's own ops on their AVX2 code).
The instructions are an AVX2 CPU's; the caches, memory and clock stay this machine's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from multitoken.embedded import SMOLLM2, SMOLLM2_EAGLE3, resolve_base
from multitoken.pipeline.eval.benchmark import Bench, add_out, best_of, cpu_model, fixture
from multitoken.pipeline.integrations import llama_cpp

OURS = {"ar": ["--mode", "ar"], "speculative": ["--mode", "speculative"],
        "lookup": ["--mode", "speculative", "--lookup", "{lookup}"],
        "eagle3": ["--mode", "speculative", "--heads", "{drafter}", "--drafter", "eagle3"]}
Q8 = "-q8"  # a method's suffix on --cpu-linear rows-q8 (int8 activations, as llama.cpp's Q4_1 kernels)
OURS.update({f"{m}{Q8}": [*flags, "--cpu-linear", "rows-q8"] for m, flags in list(OURS.items())})
LLAMA = ("plain", "lookup", "eagle3")
PLAIN = {"llama.cpp": "plain", "multitoken": "ar"}  # each engine's plain greedy run (per linear setting)


def plain_of(label: str) -> str:
    """The plain greedy run a method's text must equal: its engine's, on the same linear setting."""
    engine = label.split(":")[0]
    return f"{engine}:{PLAIN[engine]}{Q8 if label.endswith(Q8) else ''}"


def arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=f"fetched:{SMOLLM2}", help="HF dir (or fetched:NAME) holding the GGUF")
    p.add_argument("--gguf", default=None, help="llama.cpp's model (default: the one .gguf in --base, whose codes ours runs)")
    p.add_argument("--drafter", default=None, help=f"eagle3 heads dir (default: {SMOLLM2_EAGLE3.name} where shipped)")
    p.add_argument("--prompts", default=None, help="prompts file, one per line (default: held-out wikitext-2 test)")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--lookup", type=int, default=8, help="n-gram drafts per step, both engines")
    p.add_argument("--eagle3-drafts", type=int, default=None, help="llama.cpp's eagle3 drafts per step (default: the drafter's steps)")
    p.add_argument("--reps", type=int, default=1, help="repetitions of every method (the fastest kept)")
    p.add_argument("--methods", nargs="+", default=None, help="only these rows, e.g. llama.cpp:plain multitoken:ar")
    p.add_argument("--jobs", type=int, default=2, help="llama.cpp build: parallel compile jobs")
    p.add_argument("--isa", choices=list(llama_cpp.ISAS), default="native",
                   help="instruction level of both engines: native (this CPU's), or avx2 (an AVX2 CPU's code, module doc)")
    p.add_argument("--work", default=None, help="folder for the drafter's export, GGUF and our generations (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="1 prompt, 16 tokens, 1 thread: proves the pipeline, no figures")
    add_out(p, None)
    args = p.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.max_new_tokens, args.threads = 1, 16, [1]
    return args


def heldout_prompts(base_dir: Path, n: int) -> list[str]:
    """The first ``n`` held-out prompts (16-token starts of wikitext-2 test sentences), as text."""
    from transformers import AutoTokenizer
    from multitoken.pipeline.train.recipe_data import sentence_prompts

    tok = AutoTokenizer.from_pretrained(base_dir, trust_remote_code=False)
    rows = sentence_prompts(tok, [fixture("wikitext2_tokens/test.txt")], 16, seed=1)[:n]
    return [tok.decode(row).strip() for row in rows.tolist()]


def prepare_drafter(drafter: str, base_dir: Path, tree: Path, work: Path) -> tuple[Path, int]:
    """Export the eagle3 heads, convert them with llama.cpp's converter -> (GGUF, draft steps)."""
    from multitoken.pipeline.cli import main as cli

    export = work / "eagle3-export"
    if cli(["export", "--format", "eagle3", "--heads", drafter, "--out", str(export), "--overwrite"]) != 0:
        raise SystemExit(f"error: multitoken export --format eagle3 --heads {drafter} failed (its message is above)")
    out = llama_cpp.convert(tree, export, work / "eagle3-drafter.gguf", target=base_dir)
    steps = json.loads((Path(drafter) / "heads_config.json").read_text())["head_config"]["n_future"] - 1
    return out, steps


def decode_rate(trace: dict) -> tuple[int, float]:
    """(tokens, seconds) of our decoding after the prompt's pass (which yields the first token),
    as llama-completion's eval time counts it."""
    return trace["new_tokens"] - 1, trace["wall_s"] - trace["prefill_s"]


def ours_env(isa: str) -> dict:
    """Our processes' environment at the instruction level ``isa`` (native: as it is)."""
    if isa == "native":
        return dict(os.environ)
    return {**os.environ, "MULTITOKEN_CPU_FEATURES": isa, "ATEN_CPU_CAPABILITY": isa}


def ours(method: str, args, base: str, prompts_file: Path, threads: int, work: Path, drafter: str | None, rep: list) -> list[dict]:
    """One ``multitoken generate --prompts`` process: the warm-up prompt's row dropped."""
    rep[0] += 1
    out = work / f"ours-{method}-{threads}-{rep[0]}.jsonl"
    flags = [f.format(lookup=args.lookup, drafter=drafter) for f in OURS[method]]
    argv = [sys.executable, "-m", "multitoken.pipeline.cli", "generate", "--base", base, "--prompts", str(prompts_file),
            "--out", str(out), "--batch-size", "1", "--greedy", "--threads", str(threads),
            "--max-new-tokens", str(args.max_new_tokens), *flags]
    done = subprocess.run(argv, capture_output=True, text=True, env=ours_env(args.isa))
    if done.returncode != 0:
        raise RuntimeError(f"multitoken generate ({method}) exited {done.returncode}: {done.stderr[-1500:]}")
    runs = []
    for line in out.read_text().splitlines()[1:]:
        row = json.loads(line)
        tokens, seconds = decode_rate(row["trace"])
        runs.append({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                     "tokens_per_forward": row["trace"]["tokens_per_forward"], "text": row["text"]})
    return runs


def paired(runs: dict[str, list[dict]], reference: str) -> dict[str, dict]:
    """Per method: tokens/s per prompt, its ratio to ``reference``'s on the same prompt, medians,
    and whether its text is its engine's plain greedy text on each prompt (``same_text``)."""
    out = {}
    for label, rows in runs.items():
        plain = runs.get(plain_of(label)) if label != plain_of(label) else None  # itself: no check
        ratios = [r["tokens_per_s"] / ref["tokens_per_s"] for r, ref in zip(rows, runs[reference])]
        out[label] = {"tokens_per_s": [r["tokens_per_s"] for r in rows], "ratios": ratios,
                      "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
                      "median_ratio": statistics.median(ratios),
                      "same_as_plain": [llama_cpp.same_text(r["text"], p["text"]) for r, p in zip(rows, plain)] if plain else None}
        if "tokens_per_forward" in rows[0]:
            out[label]["median_tokens_per_forward"] = statistics.median(r["tokens_per_forward"] for r in rows)
    return out


def scaling(fewer: dict, more: dict) -> float:
    """The median over prompts of one method's tok/s at more threads over its tok/s at fewer."""
    return statistics.median(b / a for a, b in zip(fewer["tokens_per_s"], more["tokens_per_s"]))


def table(results: dict[int, dict], threads: list[int], record: dict) -> dict:
    """The docs table (results/llama_cpp.json's form): a row per method, tok/s and x llama.cpp
    plain per thread count, what more threads give over the first count (per prompt, the median),
    tokens per forward, and texts equal to the engine's plain greedy."""
    columns = ["method", "tokens / forward"]
    for t in threads:
        columns += [f"{t} thread{'s' * (t > 1)} tok/s", "x llama.cpp"]
    columns += [f"{t} threads: x {threads[0]}" for t in threads[1:]]
    columns.append("text = plain greedy")
    rows = []
    for label in results[threads[0]]:
        first = results[threads[0]][label]
        tpf = first.get("median_tokens_per_forward")
        row = [label, f"{tpf:.2f}" if tpf else ""]
        for t in threads:
            r = results[t][label]
            row += [f"{r['median_tokens_per_s']:.1f}", f"{r['median_ratio']:.2f}"]
        row += [f"{scaling(first, results[t][label]):.2f}" for t in threads[1:]]
        same = [s for t in threads for s in (results[t][label]["same_as_plain"] or [])]
        row.append(f"{sum(same)} of {len(same)}" if results[threads[0]][label]["same_as_plain"] is not None else "")
        rows.append(row)
    m = record["machine"]
    return {"id": "llama-cpp-side-by-side", "machine": f"{m['cores']}-core {cpu_model()}",
            "date": datetime.date.today().isoformat(), "command": record["command"], "source": "the --out record",
            "columns": columns, "rows": rows,
            "note": f"Greedy, {record['settings']['max_new_tokens']} new tokens, {record['settings']['prompts']} held-out "
                    "prompts, start-up and prompt excluded; medians over prompts of per-prompt ratios to llama.cpp plain."
                    + (" Both engines at the AVX2 level on this CPU (llama.cpp -DGGML_NATIVE=OFF; ours MULTITOKEN_CPU_FEATURES=avx2, "
                       "ATEN_CPU_CAPABILITY=avx2)." if record["settings"].get("isa", "native") != "native" else "")}


def main(argv=None) -> int:
    args = arguments(argv)
    base_dir = Path(resolve_base(args.base))
    ggufs = [Path(args.gguf)] if args.gguf else sorted(base_dir.glob("*.gguf"))
    if len(ggufs) != 1 or not ggufs[0].is_file():
        raise SystemExit(f"error: no single GGUF in {base_dir}; run `multitoken fetch smollm2` or pass --gguf FILE")
    drafter = args.drafter or (str(SMOLLM2_EAGLE3) if SMOLLM2_EAGLE3.is_dir() else None)
    prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()][:args.num_prompts] \
        if args.prompts else heldout_prompts(base_dir, args.num_prompts)
    bench = Bench("llama_cpp", args, base=str(base_dir), gguf=str(ggufs[0]), drafter=drafter, prompts=len(prompts),
                  max_new_tokens=args.max_new_tokens, threads=args.threads, lookup=args.lookup, reps=args.reps, isa=args.isa)
    tools = llama_cpp.usable_build(ggufs[0], jobs=args.jobs, log=lambda msg: print(msg, file=sys.stderr, flush=True), isa=args.isa)
    bench.record.update(llama_cpp_build=tools, prompt_texts=prompts)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-llama-cpp-"))
    work.mkdir(parents=True, exist_ok=True)
    drafter_gguf, steps = prepare_drafter(drafter, base_dir, Path(tools["source"]), work) if drafter else (None, 0)
    drafts = args.eagle3_drafts or steps
    prompts_file = work / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [prompts[0], *prompts]))  # warm-up first

    results, rep = {}, [0]
    for threads in args.threads:
        def llama(method, t=threads):
            n = drafts if method == "eagle3" else args.lookup
            return lambda: {"runs": [llama_cpp.run_tool(llama_cpp.tool_argv(tools["bin"], method, ggufs[0], p, args.max_new_tokens,
                                                                                 t, n, drafter_gguf), method, p) for p in prompts]}

        def mine(method, t=threads):
            return lambda: {"runs": ours(method, args, args.base, prompts_file, t, work, drafter, rep)}

        runs = {f"llama.cpp:{m}": llama(m) for m in LLAMA if m != "eagle3" or drafter_gguf}
        runs.update({f"multitoken:{m}": mine(m) for m in OURS if m != "eagle3" or drafter})
        runs = {k: v for k, v in runs.items() if not args.methods or k in args.methods or k == "llama.cpp:plain"}
        best = best_of(runs, args.reps, warm_up=False, score=lambda r: sum(x["seconds"] for x in r["runs"]),
                       before=lambda label: print(f"{threads} thread(s): {label}", file=sys.stderr, flush=True))
        per = {k: v["runs"] for k, v in best.items()}
        results[threads] = paired(per, "llama.cpp:plain")
        bench.record.setdefault("runs", {})[str(threads)] = per
        if "multitoken:ar" in per:  # across engines (not required: ggml's Q4_1 dot products quantise the activations)
            bench.record.setdefault("ar_text_is_llama_cpp_plain", {})[str(threads)] = [
                a["text"] == b["text"] for a, b in zip(per["multitoken:ar"], per["llama.cpp:plain"])]
        bench.record["results"] = {str(t): r for t, r in results.items()}
        bench.save()  # a long run stopped keeps what it measured
    bench.record["table"] = table(results, args.threads, bench.record)
    record = bench.save()
    print(json.dumps(record["table"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
