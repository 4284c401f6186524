"""What a training run is: the settings that shape its result and the data it reads, recorded in
every checkpoint (``state.json``'s ``run``) so that ``train --resume`` continues only the run
that made the checkpoint. Another --lr, --seed, --max-steps (the cosine schedule ends there),
head type, base, or a corpus whose bytes changed would give heads that no uninterrupted run
gives, under the old run's name: refused, naming what differs.

Left out, since they change how a run is watched or kept, not what it computes: where it writes
(--out, --checkpoint-dir), --resume, --progress, --eval-every, --save-every(-minutes),
--keep-checkpoints, and the backbone's --device, --threads and --cpu-linear.

A finished run is never rewritten by ``--resume``: when its last checkpoint is at --max-steps and
--out holds the heads it wrote then, nothing is trained or written."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from multitoken.base.data import DataConfig
from multitoken.base.errors import UsageError
from multitoken.base.hub import file_sha256
from multitoken.embedded import portable_base

FREE = ("out", "checkpoint_dir", "resume", "progress", "eval_every", "save_every", "save_every_minutes", "keep_checkpoints")
BACKBONE_FREE = ("device", "threads", "cpu_linear")
DATA_FREE = ("data",)  # the files' own bytes are compared, wherever they are


def run_fingerprint(cfg, data: DataConfig, files: dict) -> dict:
    """``{"settings": {name: value}, "data": {...}}`` of a run (JSON values, as stored).
    ``files``: ``_list_data``'s record (the data files read, and the held-out ones)."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in FREE and k != "backbone"}
    settings["heads"] = portable_base(str(cfg.heads)) if cfg.heads else None
    backbone = dataclasses.asdict(cfg.backbone)
    settings.update({k: v for k, v in backbone.items() if k not in BACKBONE_FREE})
    if backbone.get("base"):
        settings["base"] = portable_base(str(backbone["base"]))
    spec = {k: v for k, v in dataclasses.asdict(data).items() if k not in DATA_FREE}
    record = {"settings": settings, "data": {"spec": spec, **{k: _files(v) for k, v in files.items()}}}
    if files.get("data_files") is None:  # a Hub dataset: its name is all there is
        record["data"]["hub"] = data.data
    return json.loads(json.dumps(record, default=str))  # tuples as lists: equal to what state.json gives back


def _files(paths: list[str] | None) -> list[dict] | None:
    if paths is None:
        return None
    out = []
    for p in paths:
        st = Path(p).stat()
        out.append({"name": Path(p).name, "bytes": st.st_size, "sha256": file_sha256(str(Path(p).resolve()), st.st_size, st.st_mtime_ns)})
    return out


def check_same_run(recorded: dict | None, current: dict, checkpoint: Path) -> None:
    """Refuse to resume ``checkpoint`` (whose ``state.json`` recorded ``recorded``) under another
    run's settings or data. Checkpoints from before the record carry none: not checked."""
    if not isinstance(recorded, dict):
        return
    fix = ("resume with the settings and data of the run that made it; to train further or otherwise, start a new run "
           "from its heads (--heads OUT --out NEW), or pass another --checkpoint-dir")
    old, new = recorded.get("settings", {}), current["settings"]
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if changed:
        said = "; ".join(f"--{k.replace('_', '-')} {_show(old.get(k))} (now {_show(new.get(k))})" for k in changed[:3])
        raise UsageError(f"{checkpoint} was made by a run with other settings: {said}", fix)
    old, new = recorded.get("data", {}), current["data"]
    if _content(old) != _content(new):
        raise UsageError(f"{checkpoint} was made by a run on other data: {_data_change(old, new)}", fix)


def _content(data: dict) -> dict:
    """The data as it shapes a run: the spec and each file's bytes in order, not their names."""
    return {k: [(f["bytes"], f["sha256"]) for f in v] if k.endswith("_files") and v else v for k, v in data.items()}


def _show(value) -> str:
    return "(unset)" if value is None else json.dumps(value) if not isinstance(value, str) else value


def _data_change(old: dict, new: dict) -> str:
    if old.get("spec") != new.get("spec"):
        keys = [k for k in sorted(set(old.get("spec", {})) | set(new.get("spec", {})))
                if old.get("spec", {}).get(k) != new.get("spec", {}).get(k)]
        return "; ".join(f"--{k.replace('_', '-')} {_show(old['spec'].get(k))} (now {_show(new['spec'].get(k))})" for k in keys[:3])
    for key in ("data_files", "eval_data_files"):
        a, b = old.get(key) or [], new.get(key) or []
        if len(a) != len(b):
            return f"{key.replace('_', ' ')} {[f['name'] for f in a][:3]} (now {[f['name'] for f in b][:3]})"
        for fa, fb in zip(a, b):
            if (fa["bytes"], fa["sha256"]) != (fb["bytes"], fb["sha256"]):
                return f"{fb['name']} changed ({fa['bytes']:,} bytes, sha256 {fa['sha256'][:12]}; now {fb['bytes']:,} bytes, {fb['sha256'][:12]})"
    return f"the Hub dataset {old.get('hub')!r} (now {new.get('hub')!r})"


def holds_finished(cfg, step: int) -> bool:
    """--out holds the heads this run wrote when it finished at ``step`` (its metrics end there)."""
    try:
        metrics = json.loads((Path(cfg.out) / "train_metrics.json").read_text())
        return (Path(cfg.out) / "heads_config.json").is_file() and metrics[-1]["step"] == step
    except (OSError, ValueError, LookupError, TypeError):
        return False  # the final checkpoint was saved, the heads not (yet): they are written now


def already_finished(cfg, ckpt_root: Path, step: int, state: dict) -> dict:
    """--resume of a finished run: nothing is trained, and nothing rewritten (heads, metrics,
    config, checkpoints all stay as the run left them)."""
    print(f"train: {cfg.out} already holds this run's heads, finished at step {step} (--max-steps {cfg.max_steps}): "
          "nothing to do, nothing rewritten", file=sys.stderr)
    final = {k: v for k, v in (state.get("history") or [{}])[-1].items() if k != "step"}
    return {"step": step, "eval": final, "checkpoint_dir": str(ckpt_root), "out": cfg.out, "unchanged": True}
