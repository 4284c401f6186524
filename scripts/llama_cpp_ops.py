"""llama.cpp's decoding time per token, by op, for profile_step.py's ``--llama-cpp FILE``.

llama.cpp's CPU backend prints no per-op timings in its release build, so this samples
``llama-completion`` (greedy, the side-by-side bench's settings, one prompt) with Linux ``perf``
and sorts its samples by the ggml function they fell in: the Q4_1 and Q8_0 dot products, the
activations' quantisation, attention, norms, rotary, other ggml compute. Each op's time per token
is llama.cpp's own decoding time per token (``eval time``) times its share of the compute samples
(samples outside ggml's compute, such as loading and the tokenizer, are left out; the prompt's
few tokens are in the shares). Needs ``perf`` with permission to sample the process; says so and
exits non-zero where it has not.

    python scripts/llama_cpp_ops.py --threads 1 --out llama_cpp_ops.json
    python scripts/profile_step.py --threads 1 --llama-cpp llama_cpp_ops.json --out profile_step.json
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from multitoken.base.atomic import atomic_write_text
from multitoken.embedded import SMOLLM2, resolve_base
from multitoken.pipeline.integrations import llama_cpp

PROMPT = "The history of the city begins with"
# (op, pattern on the symbol): the first match names a sample's op; ggml's other compute last
OPS = (("Q4_1 dot products (ggml_vec_dot_q4_1_q8_1)", r"vec_dot_q4_1"),
       ("Q8_0 dot products: the unembedding (ggml_vec_dot_q8_0_q8_0)", r"vec_dot_q8_0"),
       ("activations to int8 (quantize_row_q8_*)", r"quantize_row_q8"),
       ("attention (flash_attn_ext, f16 dot products, softmax, exp)", r"flash_attn|vec_dot_f16|soft_max|expf|vec_mad_f16|vec_scale_f16"),
       ("norms (rms_norm)", r"rms_norm"),
       ("rotary (rope)", r"rope"),
       ("other ggml compute (mul_mat driver, add, mul, silu, get_rows, threads)", r"ggml"))


def arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=f"fetched:{SMOLLM2}", help="HF dir (or fetched:NAME) holding the GGUF")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--out", required=True, help="the JSON for profile_step.py --llama-cpp")
    return p.parse_args(argv)


def shares(report: str) -> dict[str, float]:
    """``perf report --sort symbol`` text -> each op's share of the compute samples."""
    counts = {op: 0.0 for op, _ in OPS}
    for line in report.splitlines():
        found = re.match(r"\s*([0-9.]+)%\s+\S+\s+\[[.k]\]\s+(.*)$", line)
        if not found:
            continue
        share, symbol = float(found.group(1)), found.group(2)
        op = next((op for op, pattern in OPS if re.search(pattern, symbol)), None)
        if op is not None:
            counts[op] += share
    total = sum(counts.values())
    return {op: c / total for op, c in counts.items()} if total else {}


def main(argv=None) -> int:
    args = arguments(argv)
    if shutil.which("perf") is None:
        raise SystemExit("error: `perf` is not on this machine: install linux-tools (perf) to sample llama.cpp")
    base = Path(resolve_base(args.base))
    ggufs = sorted(base.glob("*.gguf"))
    if len(ggufs) != 1:
        raise SystemExit(f"error: no single GGUF in {base}; run `multitoken fetch smollm2`")
    tools = llama_cpp.usable_build(ggufs[0], log=lambda msg: print(msg, file=sys.stderr, flush=True))
    argv_tool = llama_cpp.tool_argv(tools["bin"], "plain", ggufs[0], args.prompt, args.max_new_tokens, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        run = subprocess.run(["perf", "record", "-q", "-o", str(data), *argv_tool], capture_output=True, text=True)
        if run.returncode != 0 or not data.exists():
            raise SystemExit(f"error: perf record failed ({run.stderr.strip()[-300:]}); "
                             "allow sampling (kernel.perf_event_paranoid <= 2) or run as a user who may")
        report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,symbol", "--stdio"],
                                capture_output=True, text=True).stdout
    timing = llama_cpp.parse_timings("plain", run.stderr + run.stdout)
    per_token_us = 1e6 / timing["tokens_per_s"]
    ops = {op: round(share * per_token_us, 1) for op, share in shares(report).items()}
    record = {"source": f"perf samples of llama-completion ({args.threads} thread(s), {args.max_new_tokens} tokens, "
                        f"greedy) by ggml function, scaled to its eval time ({per_token_us:.0f} us per token): "
                        "scripts/llama_cpp_ops.py",
              "ops": ops, "eval_us_per_token": round(per_token_us, 1), "argv": argv_tool}
    atomic_write_text(Path(args.out), json.dumps(record, indent=1) + "\n")
    print(json.dumps(ops, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
