"""Turn what ``build_heads.sh`` sent back from the GPU into heads dirs for a local base.

The device returns each head set's tensors in bfloat16, in parts under its 16 MiB per file
(``heads-TYPE.NN.safetensors``, ``split_heads.py``), and every
small file in ``build.tar.gz`` (each heads dir's config, per-rank accuracies, draft vocabulary and
training record; the build report). Each heads dir is rebuilt here with its config naming the
local base (``--base``, e.g. ``fetched:SmolLM2-135M-Instruct``), its dtypes and checksum
matching the bfloat16 tensors, then loaded onto that base once (the base fingerprint check).

    python scripts/gpu/import_heads.py --from /work/.device/5 --base fetched:SmolLM2-135M-Instruct --out /tmp/gpu-heads
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from multitoken.base.quiet import quiet_dependencies
from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.pipeline.model.model import MultiTokenModel

KEEP = ("rank_accuracy.json", "draft_vocab.json")


def joined(parts: list[Path]) -> tuple[bytes, dict[str, str]]:
    """One safetensors file of every part's tensors, and each tensor's dtype name."""
    from safetensors.torch import load_file, save

    tensors = {}
    for part in parts:
        tensors.update(load_file(str(part)))
    return save(tensors, metadata={"format": "pt"}), {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()}


def import_one(kind: str, src: Path, parts: list[Path], base: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=False)
    blob, dtypes = joined(parts)
    record = json.loads((src / "heads_config.json").read_text())
    record["base"] = base
    record["dtypes"] = dtypes  # floating tensors in bfloat16, eagle3's id maps as they were
    record["heads_sha256"] = hashlib.sha256(blob).hexdigest()
    (dest / "heads.safetensors").write_bytes(blob)
    (dest / "heads_config.json").write_text(json.dumps(record, indent=2) + "\n")
    for name in KEEP:
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    shutil.copy(src / "train_metrics.json", dest / "build_report.json")
    MultiTokenModel.from_pretrained(BackboneConfig(base=base, cpu_linear="stock"), str(dest))  # loads: shapes, fingerprint


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="src", required=True, help="the folder the device's files came back to")
    p.add_argument("--base", required=True)
    p.add_argument("--out", required=True, help="new folder: one heads dir per type, and the build report")
    args = p.parse_args()
    quiet_dependencies()
    src, out = Path(args.src), Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(src / "build.tar.gz") as tar:
            tar.extractall(tmp, filter="data")
        out.mkdir(parents=True, exist_ok=False)
        shutil.copy(Path(tmp) / "report" / "build_report.json", out / "build_report.json")
        kinds = sorted({p.name.split(".")[0] for p in src.glob("heads-*.safetensors")})
        for kind in kinds:
            import_one(kind, Path(tmp) / kind, sorted(src.glob(f"{kind}.*safetensors")), args.base, out / kind)
            print(f"{out / kind}: loaded onto {args.base}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
