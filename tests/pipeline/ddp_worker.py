"""Run by ``torchrun`` from test_train_cli.py: train, then dump this rank's trainable weights.

    ddp_worker.py HEADS DATA OUT DUMP_PREFIX MODE BATCH [GRAD_ACCUM]

Without ``torchrun`` (no WORLD_SIZE) it trains as one process: the reference run.
"""

from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import save_file

from multitoken.base.data import DataConfig
from multitoken.pipeline.train.train import Dist, init_distributed, load_trainable_model, train
from multitoken.pipeline.train.trainer_config import TrainConfig


def run(heads: str, data: str, out: str, dump: str, mode: str, batch: str, accum: str = "1") -> None:
    cfg = TrainConfig(heads=heads, out=out, eval_data=data, max_steps=4, seq_len=32, batch_size=int(batch),
                      grad_accum=int(accum), lr=5e-3, mode=mode,
                      head_warmup_steps=2 if mode == "warmup" else 0, eval_every=2, eval_batches=1, save_every=2,
                      progress=False, seed=0)
    torch.manual_seed(cfg.seed)
    dist = init_distributed(cfg) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else Dist()
    model = load_trainable_model(cfg, dist)
    train(cfg, DataConfig(data=data), model=model)
    state = {n: p.detach().contiguous() for n, p in model.named_parameters() if "lora_" in n or n.startswith("heads.")}
    save_file(state, f"{dump}-rank{dist.rank}.safetensors")
    if dist.world > 1:  # as every torchrun script should: a gloo group alive at exit can abort the rank
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(*sys.argv[1:8])
