"""Run many ``multitoken`` command lines, each in its own process, without paying torch's
import (~2 s of CPU) per process: this script imports the CLI once, then forks one child per
case. A child is a fresh process for what a case can observe: its own cwd, environment, stdin,
stdout and stderr (files), exit code, and interpreter exit (atexit handlers run); an exception
escaping ``main`` prints its traceback as ``python -m multitoken.pipeline.cli`` would.

Usage: python cli_zygote.py CASES.json RESULTS.json [PARALLEL]
CASES.json: {name: {"args": [...], "cwd": str | null, "env": {...} | null}}
RESULTS.json: {name: {"returncode": int, "stdout": str, "stderr": str}}
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

TIMEOUT_S = 120


def _child(case: dict, out: str, err: str) -> None:
    """Runs in the forked child; never returns."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    if case.get("env") is not None:
        os.environ.clear()
        os.environ.update(case["env"])
    if case.get("cwd"):
        os.chdir(case["cwd"])
    from multitoken.pipeline.cli import main

    sys.argv = ["multitoken", *case["args"]]
    try:
        code = main(case["args"])
    except SystemExit as stop:  # argparse's errors (exit 2), --help
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- a traceback here is what the bad-input suite looks for
        traceback.print_exc()
        code = 1
    sys.exit(code)  # interpreter exit: atexit handlers and flushes, as in a real process


def run_all(cases: dict, workdir: str, parallel: int) -> dict:
    import multitoken.pipeline.cli as cli

    for command in ("generate", "train", "eval", "sweep", "stats", "attach", "distill", "convert-llama2c"):
        cli.build_parser(command)  # imports every command's modules once, before forking
    import transformers  # noqa: F401 -- most cases load a model

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
                         "stdout": open(out, errors="replace").read(), "stderr": open(err, errors="replace").read()}
    return results


if __name__ == "__main__":
    cases_file, results_file = sys.argv[1], sys.argv[2]
    parallel = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    cases = json.load(open(cases_file))
    results = run_all(cases, os.path.dirname(os.path.abspath(results_file)), parallel)
    with open(results_file, "w") as fh:
        json.dump(results, fh)
