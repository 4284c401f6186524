"""Training throughput and memory on the pythia-mini fixture (prints and writes JSON).

Every measurement runs in a fresh child process (``--child``) so that peak memory is that
measurement's own: peak RSS is sampled every 2 ms by a thread during the measured
region, and reported as the rise over the RSS just before it (model loaded, data ready).

Times are taken twice: wall clock, and the process's CPU time (torch runs single-threaded by
default here, so CPU time is compute time; the parts and the full step are timed without the
memory sampler running). On a shared machine the
wall clock mostly measures the neighbours; the CPU-time figures (``cpu_*``) are the stable
ones and the targets use them.

Measured, at the same batch (default seq 256, batch 8):
- ``backbone_forward``: the base model's own full forward (logits included), no autograd;
- per mode (``heads`` = frozen backbone, ``lora`` = joint LoRA q/k/v r 8, ``heads_4bit`` =
  frozen 4-bit backbone), n = 3: tokens/s and peak memory of whole trainer steps;
- parts of a heads-only step: one backbone pass without autograd (trunk + final layer, what
  the heads read), one new head's forward + backward (layer + chunked unembedding CE), one
  AdamW step; compared with the full step. Head 1's loss (a constant with a frozen backbone)
  is timed too, and the step's loss + backward with and without scoring it: the trainer skips
  it (``skip_constant``) unless ``--loss-balance rms`` needs its value;
- peak memory of heads-only steps for n = 2 and n = 4.

    python scripts/bench_train.py --out bench_train.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

from multitoken.pipeline.eval.benchmark import FIXTURES, Bench, add_out, best_of, fixture


class PeakRSS:
    """Peak resident memory (bytes) above the level at ``__enter__``, sampled every 2 ms."""

    def __enter__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self.page

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def rise_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def _batch(tokenizer, batch: int, seq: int):
    """Real text (tinyshakespeare) when the fixture exists, else seeded random ids # [B, T]."""
    import torch

    text = FIXTURES / "tinyshakespeare" / "input.txt"
    need = batch * seq
    if text.is_file():
        ids = tokenizer(text.read_text()[: need * 8], add_special_tokens=False)["input_ids"][:need]
        if len(ids) == need:
            return torch.tensor(ids).view(batch, seq), "tinyshakespeare"
    return torch.randint(2, 50000, (batch, seq), generator=torch.Generator().manual_seed(0)), "random ids"


def _model(mode: str, n: int):
    import torch

    from multitoken.pipeline.model.loading import BackboneConfig, LoraSpec, load_backbone
    from multitoken.pipeline.model.model import MultiTokenModel

    torch.manual_seed(0)
    quant = "4bit" if mode == "heads_4bit" else None
    lora = LoraSpec() if mode == "lora" else None
    backbone = load_backbone(BackboneConfig(base=str(FIXTURES / "pythia-mini"), quantization=quant),
                             lora=lora, trainable_lora=lora is not None)
    return MultiTokenModel.attach(backbone, {"head_type": "replicated", "n_future": n})


def _trainer(model, mode: str, steps: int):
    import torch

    from multitoken.pipeline.train import optim
    from multitoken.pipeline.train.train import Dist, Runner
    from multitoken.pipeline.train.trainer_config import TrainConfig

    cfg = TrainConfig(heads=".", out=".", mode="joint" if mode == "lora" else "heads", max_steps=steps, lr=1e-4)
    optimizer = torch.optim.AdamW(optim.param_groups(model, cfg), lr=cfg.lr)
    return cfg, optimizer, Runner(model, Dist())


def child_steps(mode: str, n: int, batch: int, seq: int, steps: int) -> dict:
    """Tokens/s and peak memory of whole trainer steps (one warm-up step first, untimed)."""
    from multitoken.pipeline.train.train import train_step

    model = _model(mode, n)
    ids, source = _batch(model.backbone.tokenizer, batch, seq)
    cfg, optimizer, runner = _trainer(model, mode, steps + 1)
    rows = ids.numpy()
    with PeakRSS() as mem:
        train_step(runner, optimizer, rows, cfg, 0)
        wall, cpu = _clock()
        for step in range(1, steps + 1):
            train_step(runner, optimizer, rows, cfg, step)
        wall, cpu = _since(wall, cpu, steps)
    return {"mode": mode, "n": n, **_rates(wall, cpu, batch * seq), "peak_rise_mb": mem.rise_mb, "data": source}


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(wall: float, cpu: float, count: int) -> tuple[float, float]:
    now_wall, now_cpu = _clock()
    return (now_wall - wall) / count, (now_cpu - cpu) / count


def _rates(wall: float, cpu: float, tokens: int) -> dict:
    return {"step_s": wall, "cpu_step_s": cpu, "tokens_per_s": tokens / wall, "cpu_tokens_per_s": tokens / cpu}


def child_backbone(batch: int, seq: int, steps: int) -> dict:
    """The base model's own forward (HF causal LM, logits included), no autograd."""
    import torch

    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

    backbone = load_backbone(BackboneConfig(base=str(FIXTURES / "pythia-mini")))
    ids, _ = _batch(backbone.tokenizer, batch, seq)
    with PeakRSS() as mem, torch.no_grad():
        backbone.model(ids)
        wall, cpu = _clock()
        for _ in range(steps):
            backbone.model(ids)
        wall, cpu = _since(wall, cpu, steps)
    return {"mode": "backbone_forward", **_rates(wall, cpu, batch * seq), "peak_rise_mb": mem.rise_mb}


def _cpu_best(calls: dict, repeats: int) -> dict[str, float]:
    """Each call's fewest process CPU seconds over ``repeats`` interleaved repetitions (after a
    warm-up of each): CPU time, since the wall clock on a shared machine measures the neighbours."""
    def timed(fn):
        def run() -> dict:
            start = time.process_time()
            fn()
            return {"cpu_s": time.process_time() - start}
        return run

    best = best_of({name: timed(fn) for name, fn in calls.items()}, repeats, score=lambda r: r["cpu_s"])
    return {name: r["cpu_s"] for name, r in best.items()}


def child_parts(n: int, batch: int, seq: int, repeats: int) -> dict:
    """Fewest CPU seconds of each part of a heads-only step, and of the full step."""
    import torch

    from multitoken.adapters.base import DEFAULT_CHUNK, chunked_cross_entropy, shifted_targets
    from multitoken.pipeline.train import optim
    from multitoken.pipeline.train.train import train_step

    model = _model("heads", n)
    ids, _ = _batch(model.backbone.tokenizer, batch, seq)
    cfg, optimizer, runner = _trainer(model, "heads", 10 * repeats)
    valid = torch.ones_like(ids, dtype=torch.bool)
    unembed = model.backbone.unembedding
    with torch.no_grad():
        feats = model.features(ids)

    def backbone_pass():
        with torch.no_grad():
            model.features(ids)

    def head_fb():  # head 2: its layer, chunked CE, backward into its weights
        ce, _ = chunked_cross_entropy(unembed, model.heads.hidden(1, feats), shifted_targets(ids, valid, 2), DEFAULT_CHUNK)
        ce.backward()

    def head1_loss():
        with torch.no_grad():
            chunked_cross_entropy(unembed, feats.base, shifted_targets(ids, valid, 1), DEFAULT_CHUNK)

    def loss_backward(skip: bool):  # the step's loss + backward, head 1's constant term scored or not
        optimizer.zero_grad(set_to_none=True)
        optim.combine_losses(model.compute_loss(ids, skip_constant=skip), cfg, 1.0).backward()

    head_fb()  # gradients exist, so AdamW does its full work
    rows = ids.numpy()
    counter = iter(range(10 * repeats))
    cpu = _cpu_best({"backbone_no_grad": backbone_pass, "head_fwd_bwd": head_fb, "head1_loss_no_grad": head1_loss,
                     "optimizer_step": optimizer.step, "loss_backward_scoring_head1": lambda: loss_backward(False),
                     "loss_backward_skipping_head1": lambda: loss_backward(True),
                     "full_step": lambda: train_step(runner, optimizer, rows, cfg, next(counter))}, repeats)
    parts = {k: cpu[k] for k in ("backbone_no_grad", "head_fwd_bwd", "head1_loss_no_grad", "optimizer_step")}
    skip = {k: cpu[k] for k in ("loss_backward_scoring_head1", "loss_backward_skipping_head1")}
    skip["speedup"] = skip["loss_backward_scoring_head1"] / skip["loss_backward_skipping_head1"]
    full = cpu["full_step"]
    # a heads-only step skips head 1's loss (a constant there): it is not one of the step's parts
    total = parts["backbone_no_grad"] + (n - 1) * parts["head_fwd_bwd"] + parts["optimizer_step"]
    return {"n": n, "cpu_parts_s": parts, "cpu_sum_of_parts_s": total, "cpu_full_step_s": full, "full_over_parts": full / total,
            "skipping_head1_cpu_s": skip}


def run_child(args, *extra) -> dict:
    cmd = [sys.executable, __file__, "--child", *extra, "--batch", str(args.batch), "--seq", str(args.seq),
           "--steps", str(args.steps), "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench child {extra} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result), flush=True)
    return result


def parent(args) -> dict:
    fixture("pythia-mini/config.json")
    bench = Bench("train", args, batch=args.batch, seq=args.seq, steps=args.steps, threads=args.threads)
    backbone = run_child(args, "backbone")
    modes = {m: run_child(args, "steps", m, "3") for m in ("heads", "lora", "heads_4bit")}
    memory_n = {n: run_child(args, "steps", "heads", str(n)) for n in (2, 4)}
    parts = run_child(args, "parts", "heads", "3")
    fwd_mem = backbone["peak_rise_mb"]
    bench.record.update({
        "model": "pythia-mini (GPT-NeoX, hidden 128, 6 layers, vocab 50304)",
        "backbone_forward": backbone, "modes": modes, "parts": parts,
        "memory": {
            "heads_n2_mb": memory_n[2]["peak_rise_mb"], "heads_n4_mb": memory_n[4]["peak_rise_mb"],
            "n4_over_n2": memory_n[4]["peak_rise_mb"] / memory_n[2]["peak_rise_mb"],
            "backbone_forward_mb": fwd_mem, "heads_n3_over_backbone_forward": modes["heads"]["peak_rise_mb"] / fwd_mem,
        },
        "targets": {
            "full_step_over_parts<=1.15": parts["full_over_parts"] <= 1.15,
            "n4_vs_n2_within_10%": abs(memory_n[4]["peak_rise_mb"] / memory_n[2]["peak_rise_mb"] - 1) <= 0.10,
            "heads_peak<=2x_backbone_forward": max(memory_n[4]["peak_rise_mb"], modes["heads"]["peak_rise_mb"]) <= 2 * fwd_mem,
        },
    })
    report = bench.save()
    print(json.dumps(report, indent=2))
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "bench_train.json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: stable numbers on a shared machine)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.child:
        parent(args)
        return 0
    import torch

    torch.set_num_threads(args.threads)
    kind, *rest = args.child
    if kind == "backbone":
        result = child_backbone(args.batch, args.seq, args.steps)
    elif kind == "steps":
        result = child_steps(rest[0], int(rest[1]), args.batch, args.seq, args.steps)
    else:
        result = child_parts(int(rest[1]), args.batch, args.seq, max(args.steps, 3))
    result["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
