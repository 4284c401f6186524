"""Write each heads dir's tensors in bfloat16 as files a device call can send back (< 16 MiB each).

    python split_heads.py OUT HEADS_DIR...

``OUT/heads-TYPE.NN.safetensors`` (NN = 00, 01, ...): the dir's tensors, floating ones in
bfloat16 (what ships), integer and boolean ones (eagle3's id maps ``d2t`` / ``t2d``) as they are,
packed in name order into parts under ``LIMIT`` bytes. ``import_heads.py`` joins the parts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LIMIT = 15 << 20  # under the device's 16 MiB per returned file, with room for the header


def split(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """``tensors`` in name order, packed into parts of at most ``limit`` bytes each."""
    parts, size = [{}], 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if nbytes > limit:
            raise SystemExit(f"{name} alone is {nbytes:,} bytes, over the {limit:,}-byte part limit")
        if size + nbytes > limit and parts[-1]:
            parts.append({})
            size = 0
        parts[-1][name] = t
        size += nbytes
    return parts


def main(out: str, *dirs: str) -> int:
    for folder in map(Path, dirs):
        tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
                   for k, v in load_file(str(folder / "heads.safetensors")).items()}
        for i, part in enumerate(split(tensors, LIMIT)):
            save_file(part, str(Path(out) / f"{folder.name}.{i:02d}.safetensors"), metadata={"format": "pt"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
