"""Run many ``multitoken`` command lines, each in its own process, without paying torch's
import (~2 s of CPU) per process: this script imports the CLI once, then forks one child per
case. A child is a fresh process for what a case can observe: its own cwd, stdin, stdout and
stderr (files), exit code, and interpreter exit (atexit handlers run, then the interpreter's own
teardown); an exception escaping ``main`` prints its traceback as ``python -m
multitoken.pipeline.cli`` would. The environment is this script's own, read by the libraries as
they are imported here: the caller starts one zygote per environment (``run_forked``).

Usage: python cli_zygote.py CASES.json RESULTS.json [PARALLEL]
CASES.json: {name: {"args": [...], "cwd": str | null}}
RESULTS.json: {name: {"returncode": int, "seconds": float, "stdout": str, "stderr": str,
                      "connects": [address, ...], "main_s": float}}
  (seconds: fork to exit; connects: every socket connect the child attempted; main_s: the wall
  time of ``main`` alone, without the process's start and exit)
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import signal
import sys
import time
import traceback

TIMEOUT_S = 120
# Imported before forking, besides every command's own modules: what loading the embedded
# stories260K (a Llama) imports lazily through transformers, and the readers most cases reach
# (weights, zstd corpora). Each would otherwise be imported again by every child.
PRELOAD = ("transformers.models.llama.configuration_llama", "transformers.models.llama.modeling_llama",
           "transformers.models.llama.tokenization_llama", "transformers.tokenization_utils_sentencepiece",
           "safetensors.torch", "zstandard")


def _child(case: dict, out: str, err: str) -> None:
    """Runs in the forked child; never returns."""
    seen = {"connects": [], "main_s": None}  # what the parent reads back, written at exit
    connects = seen["connects"]
    atexit.register(_write_json, out + ".seen", seen)  # registered first: runs last
    sys.addaudithook(lambda event, args: connects.append(_address(args[1])) if event == "socket.connect" else None)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    if case.get("cwd"):
        os.chdir(case["cwd"])
    from multitoken.pipeline.cli import main

    sys.argv = ["multitoken", *case["args"]]
    start = time.perf_counter()
    try:
        code = main(case["args"])
    except SystemExit as stop:  # argparse's errors (exit 2), --help
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- a traceback here is what the bad-input suite looks for
        traceback.print_exc()
        code = 1
    seen["main_s"] = round(time.perf_counter() - start, 3)
    sys.exit(code)  # interpreter exit: atexit handlers and flushes, as in a real process


def _address(address) -> list | str:
    """A socket address as JSON: [host, port, ...] for IP, the path's text for a Unix socket."""
    return list(address) if isinstance(address, tuple) else str(address)


def _write_json(path: str, value) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh)


def _preload() -> None:
    """What a child would import, in the order ``main`` imports it: its switch of dependencies'
    console output first (environment variables read at import), then every command's modules."""
    import multitoken.pipeline.cli as cli
    from multitoken.base.quiet import quiet_dependencies

    quiet_dependencies()
    for command in ("generate", "train", "eval", "sweep", "stats", "attach", "distill", "convert-llama2c"):
        cli.build_parser(command)
    for module in PRELOAD:
        importlib.import_module(module)
    # Out of the collector's sight: a child's teardown then leaves these pages shared, instead of
    # touching (so copying) every imported object.
    gc.freeze()


def run_all(cases: dict, workdir: str, parallel: int) -> dict:
    _preload()

    pending, running, results = list(enumerate(cases.items())), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            index, (name, case) = pending.pop(0)
            out, err = os.path.join(workdir, f"{index}.out"), os.path.join(workdir, f"{index}.err")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(case, out, err)
            running[pid] = (name, out, err, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for child, (_, _, _, started) in running.items():
                if time.monotonic() - started > TIMEOUT_S:
                    os.kill(child, signal.SIGKILL)
            time.sleep(0.02)
            continue
        name, out, err, started = running.pop(pid)
        results[name] = {"returncode": os.waitstatus_to_exitcode(status), "seconds": round(time.monotonic() - started, 2),
                         "stdout": open(out, errors="replace").read(), "stderr": open(err, errors="replace").read(),
                         **_read_seen(out + ".seen")}
    return results


def _read_seen(path: str) -> dict:
    """The child's socket connects and the time its ``main`` took, each None where it died
    before its exit handlers ran."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return {"connects": None, "main_s": None}


if __name__ == "__main__":
    cases_file, results_file = sys.argv[1], sys.argv[2]
    parallel = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    cases = json.load(open(cases_file))
    results = run_all(cases, os.path.dirname(os.path.abspath(results_file)), parallel)
    _write_json(results_file, results)
