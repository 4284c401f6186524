"""``multitoken train`` from the command line: end to end, errors, and DDP under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from multitoken.pipeline.cli import main

WORKER = Path(__file__).with_name("ddp_worker.py")


def _train(*args: str) -> int:
    return main(["train", "--no-progress", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", *args])


def test_attach_then_train_from_the_cli(tiny_llama_dir, corpus, tmp_path, capsys):
    heads = tmp_path / "heads"
    assert main(["attach", "--base", str(tiny_llama_dir), "--head", "replicated", "--n", "3", "--out", str(heads)]) == 0
    capsys.readouterr()
    out = tmp_path / "trained"
    assert _train("--heads", str(heads), "--data", str(corpus), "--max-steps", "3", "--out", str(out), "--eval-every", "2",
                  "--mode", "warmup", "--head-warmup-steps", "1", "--head-lr-mult", "4", "--loss-balance", "rms") == 0
    cap = capsys.readouterr()
    lines = cap.out.strip().splitlines()  # a short readable summary, no JSON line
    assert lines[0] == f"trained 3 steps; heads written to {out}" and lines[1] == "held-out evaluation:"
    assert [line.split()[0] for line in lines[3:6]] == ["1", "2", "3"] and len(lines) == 8
    assert not any(line.lstrip().startswith("{") for line in lines)
    history = json.loads((out / "train_metrics.json").read_text())  # the JSON stays in its file
    assert [h["step"] for h in history] == [2, 3] and "head2/top5" in history[-1]
    evals = [line for line in cap.err.splitlines() if " eval: " in line]
    assert evals == [f"step 2/3 eval: loss {history[0]['head1/loss']:.3f} {history[0]['head2/loss']:.3f} "
                     f"{history[0]['head3/loss']:.3f} | top-1 {history[0]['head1/top1']:.3f} {history[0]['head2/top1']:.3f} "
                     f"{history[0]['head3/top1']:.3f} (heads 1..3)"]
    assert f"data: reading 1 file\n  {corpus}\n" in cap.err
    assert {"heads.safetensors", "heads_config.json", "train_config.json", "train_metrics.json", "lora"} <= {p.name for p in out.iterdir()}
    assert (tmp_path / "trained.checkpoints" / "step-00000003" / "state.json").is_file()
    # Training again into the same dir needs --resume; with it, the finished run is a no-op.
    assert _train("--heads", str(heads), "--data", str(corpus), "--max-steps", "3", "--out", str(out)) == 2
    assert "--resume" in capsys.readouterr().err


@pytest.mark.parametrize("fails", [False, True])
def test_main_leaves_the_process_group_its_command_joined_once_it_succeeds(tiny_llama_dir, tmp_path, capsys, monkeypatch,
                                                                          fails):
    """A gloo group alive at interpreter exit can abort a torchrun rank after its work is done
    (``terminate called without an active exception``): main leaves the group its command joined
    once the command succeeds; not after an error (other ranks may still wait in a collective),
    and never a group its caller had joined."""
    import torch.distributed as tdist

    from multitoken.base.errors import UsageError
    from multitoken.pipeline.cli import cmd_attach

    def joins(args):  # a command that joins a group of one, as torchrun's commands do
        tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        if fails:
            raise UsageError("planted", "none")

    real = cmd_attach.run
    monkeypatch.setattr(cmd_attach, "run", joins)
    try:
        assert (main(["attach", "--out", str(tmp_path / "a")]) != 0) == fails
        assert tdist.is_initialized() == fails
        if fails:
            tdist.destroy_process_group()
        monkeypatch.setattr(cmd_attach, "run", real)
        tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store2'}", rank=0, world_size=1)  # the caller's
        assert main(["attach", "--base", str(tiny_llama_dir), "--head", "medusa", "--n", "2", "--out", str(tmp_path / "b")]) == 0
        assert tdist.is_initialized()
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


def test_resume_needs_a_checkpoint_to_continue_finished_heads(heads_dir, corpus, tmp_path, capsys):
    import shutil

    out = tmp_path / "t"
    args = ["--heads", str(heads_dir), "--data", str(corpus), "--out", str(out), "--max-steps", "1"]
    assert _train(*args) == 0
    shutil.rmtree(tmp_path / "t.checkpoints")
    before = (out / "heads.safetensors").read_bytes()
    capsys.readouterr()
    assert _train(*args, "--resume", "--lr", "1e-2") == 2  # nothing to resume: the finished heads stay
    err = capsys.readouterr().err
    assert "holds no checkpoint to continue from" in err and "--overwrite" in err and "Traceback" not in err
    assert (out / "heads.safetensors").read_bytes() == before
    assert _train(*args, "--resume", "--lr", "1e-2", "--overwrite") == 0  # asked for: trained anew over them
    assert (out / "heads.safetensors").read_bytes() != before


@pytest.mark.parametrize("args, code, message", [
    (["--heads", "NOPE", "--data", "CORPUS", "--out", "OUT"], 2, "does not exist"),
    (["--heads", "HEADS", "--out", "OUT"], 2, "no training data"),
    (["--heads", "HEADS", "--data", "MISSING.jsonl", "--out", "OUT"], 1, "MISSING.jsonl"),
    (["--heads", "HEADS", "--data", "CORPUS", "--out", "OUT", "--mode", "warmup"], 2, "head-warmup-steps"),
    (["--heads", "HEADS", "--data", "CORPUS", "--out", "OUT", "--seq-len", "100000", "--max-steps", "1"], 1, "fewer than"),
    (["--heads", "CORPUS", "--data", "CORPUS", "--out", "OUT"], 2, "does not exist"),
    (["--heads", "EMPTY", "--data", "CORPUS", "--out", "OUT"], 1, "heads_config.json"),
])
def test_cli_errors_are_clear_and_leave_no_output(heads_dir, corpus, tmp_path, capsys, args, code, message):
    (tmp_path / "empty").mkdir()
    subst = {"HEADS": str(heads_dir), "CORPUS": str(corpus), "OUT": str(tmp_path / "out"),
             "MISSING.jsonl": str(tmp_path / "MISSING.jsonl"), "NOPE": str(tmp_path / "nope"), "EMPTY": str(tmp_path / "empty")}
    assert _train(*[subst.get(a, a) for a in args]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _worker_args(tmp_path: Path, heads: Path, corpus: Path, tag: str, mode: str, batch: int, accum: int = 1) -> list[str]:
    return [str(heads), str(corpus), str(tmp_path / f"out-{tag}"), str(tmp_path / tag), mode, str(batch), str(accum)]


# Why the ranks must match the one-process run bit for bit (tolerance 0, on any machine):
# one step of 2 ranks x batch 2 and one step of 1 process x 2 micro-batches of 2 (grad_accum 2)
# see the same rows in the same groups (``_rank_rows``: micro-batch k = rank k's rows), and run
# each group through the same code on tensors of the same shapes with one thread each (the
# worker pins it), so each group's gradient g_k is the same float32 bits in both. What differs
# is only how the two are combined: DDP averages (g_0 + g_1) / 2 (or g_0/2 + g_1/2, pre-divided),
# the one process backpropagates L_k / 2, which yields exactly g_k / 2 (autograd is linear in the
# upstream gradient and scaling by a power of two is exact in binary floating point barring
# under/overflow), and accumulates g_0/2 + g_1/2. A sum of two floats is commutative and x/2 is
# exact, so every gradient, hence the clip factor and every AdamW update, is bitwise equal, step
# after step. By contrast one process with batch 4 reduces over 4 rows in one GEMM: a different
# summation order, float32 rounding of ~M u |terms| (u = 2^-24, M = 128 rows) per gradient
# element, which AdamW's per-element normalisation m / sqrt(v) turns into update errors of up to
# lr x (relative gradient error): unbounded for an element whose gradient nearly cancels (seen:
# 1.2e-5 on one element on a 16-thread machine, 2e-6 on a 2-core one), so no element-wise
# tolerance against the batch-4 run follows from the arithmetic; it is not compared.
# "warmup" covers both phases (frozen backbone, then LoRA with DDP rebuilt over it).
@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["warmup", pytest.param("heads", marks=pytest.mark.slow)])
def test_ddp_two_ranks_end_equal_and_match_one_process(heads_dir, corpus, tmp_path, mode):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    done = subprocess.run([*launcher, *_worker_args(tmp_path, heads_dir, corpus, "ddp", mode, 2)], capture_output=True,
                          text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    # The reference: one process (no torchrun), 2 micro-batches of 2 rows per step, one thread.
    done = subprocess.run([sys.executable, str(WORKER), *_worker_args(tmp_path, heads_dir, corpus, "single", mode, 2, 2)],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    r0, r1 = load_file(str(tmp_path / "ddp-rank0.safetensors")), load_file(str(tmp_path / "ddp-rank1.safetensors"))
    single = load_file(str(tmp_path / "single-rank0.safetensors"))
    assert r0.keys() == r1.keys() == single.keys() and any("lora_" in k for k in r0) == (mode == "warmup")
    initial = load_file(str(heads_dir / "heads.safetensors"))
    assert any(not torch.equal(single[k], initial[k.removeprefix("heads.")]) for k in single if k.startswith("heads."))
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
        assert torch.equal(r0[k], single[k]), (k, float((r0[k] - single[k]).abs().max()))
    assert (tmp_path / "out-ddp" / "heads.safetensors").is_file()
