"""Output guards: every command that writes checks its destination before any work.

``prepare_output(path, kind, overwrite=..., inputs=...)`` is called at the very start of a
command's run, before a model or a corpus is loaded, so that a bad ``--out`` fails in the
first second instead of throwing the finished work away. The rules:

- the destination is new, an empty directory, or a directory holding this command's own kind
  of output (recognised by its marker file); the latter only with ``--overwrite`` (or when the
  command resumes its own interrupted job there);
- a directory holding files we did not write and no marker is refused (nothing of the user's is
  ever replaced); our own outputs are replaced entry by entry, other files beside them stay;
- never ``.``, the home directory, ``/``, an input or a parent of an input, an existing file
  (for commands writing a directory), or a file not of our kind (for ``distill``);
- the place is probed: a temp file is created, written, synced and removed, so read-only,
  full or not-a-directory destinations fail now.

Imports nothing of ours but ``errors`` and ``atomic`` (base layer).
"""

from __future__ import annotations

import fnmatch
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from multitoken.base.errors import UsageError

PROBE_BYTES = 4096
MIN_FREE_BYTES = 1 << 20


@dataclass(frozen=True)
class OutputKind:
    """What one command writes into its output directory."""

    label: str                          # "a heads dir", for messages
    marker: str | None                  # the file that marks a complete output
    owned: tuple[str, ...]              # entry names (fnmatch) the command writes
    # directories that are ours only if every entry inside matches these patterns
    nested: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # files that are ours only if they are a JSON object with this "command" prefix
    commands: dict[str, str] = field(default_factory=dict)

    def owns(self, entry: Path) -> bool:
        name = entry.name
        if not any(fnmatch.fnmatchcase(name, p) for p in self.owned):
            return False
        if name in self.nested:
            return entry.is_dir() and all(any(fnmatch.fnmatchcase(c.name, p) for p in self.nested[name])
                                          for c in entry.iterdir())
        if name in self.commands:
            return str(_json_object(entry).get("command", "")).startswith(self.commands[name])
        return True


HEADS = OutputKind("a heads dir", "heads_config.json",
                   ("heads_config.json", "heads.safetensors", "lora", "attach_config.json",
                    "train_config.json", "train_metrics.json", "rank_accuracy.json"))
STATS = OutputKind("a stats dir", "meta.json",
                   ("meta.json", "config.json", "counts[0-9].npy", "keys[0-9].npy", "partials", "merge-parts"),
                   nested={"partials": ("shard-*", ".lock", ".shard-*"), "merge-parts": ("o[0-9]-part-*", ".o[0-9]-part-*")},
                   commands={"config.json": "stats "})
EVAL = OutputKind("an eval report", "report.json", ("report.json", "eval_config.json", "logit_lens.png", "rank_accuracy.json"))
SWEEP = OutputKind("a sweep", "sweep.json", ("sweep.json", "sweep.csv", "sweep.png", "sweep_config.json"))
CONVERTED = OutputKind("a converted model", "conversion.json",
                       ("conversion.json", "config.json", "generation_config.json", "model.safetensors",
                        "tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                        "added_tokens.json"))
CHECKPOINTS = OutputKind("training checkpoints", None, ("step-[0-9]*",))
KINDS = {"heads": HEADS, "stats": STATS, "eval": EVAL, "sweep": SWEEP, "convert": CONVERTED, "checkpoints": CHECKPOINTS}


def add_overwrite_flag(parser) -> None:
    """``--overwrite``: the same flag with the same meaning on every command that writes."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output of this command in --out (only its own files; others stay)")


def _json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _ignorable(entry: Path) -> bool:
    """Leftovers of our own killed writes (removed by the next write)."""
    return entry.name.startswith(".") and (".tmp-" in entry.name or ".old-" in entry.name or entry.name == ".lock")


def _resolve(path: str) -> Path:
    return Path(os.path.abspath(Path(path).expanduser()))


def _check_place(out: Path, shown: str, inputs) -> None:
    """Never the current dir, the home dir, the root, an input or a parent of an input."""
    real = out.resolve()
    specials = {Path.cwd().resolve(): "the current directory", Path.home().resolve(): "your home directory",
                Path(real.anchor): "the root directory"}
    if real in specials:
        raise UsageError(f"--out {shown} is {specials[real]}", "pass a new directory for the output, e.g. --out results/")
    for spec in inputs:
        if not spec:
            continue
        head = str(spec).split("*")[0].split("?")[0].split("[")[0]  # the fixed part of a glob
        inp = _resolve(head).resolve() if head else None
        if inp is None:
            continue
        if real == inp or real in inp.parents:
            what = "the input" if real == inp else "a parent of the input"
            raise UsageError(f"--out {shown} is {what} {spec}", "write the output somewhere else: it must not hold the inputs")


def _probe(place: Path, shown: str) -> None:
    """Create, write, sync and remove a temp file in ``place`` (an existing directory), then
    check the disk's free space: read-only, full or foreign places fail here, before any work."""
    fix = "pass an --out on a writable disk with free space"
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".multitoken-probe-", dir=place)
        with os.fdopen(fd, "wb") as fh:
            fh.write(b"\0" * PROBE_BYTES)
            fh.flush()
            os.fsync(fh.fileno())
        st = os.statvfs(place)
    except OSError as err:
        raise UsageError(f"cannot write to {place} (for --out {shown}): {err.strerror or err}", fix) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
        raise UsageError(f"no space left on the disk of --out {shown} ({place}: {st.f_bavail * st.f_frsize} bytes free)", fix)


def _existing_parent(out: Path, shown: str) -> Path:
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--out {shown}: {parent} is a file, not a directory", "pass a path whose parents are directories")
    return parent


def prepare_output(path: str | None, kind: str, *, overwrite: bool = False, inputs=(), resume: bool = False) -> Path:
    """Check ``path`` as the output directory of a ``kind`` command (see the module doc).

    ``resume``: the command continues its own interrupted or finished job there (it checks that
    the job is the same itself), so an existing output of this kind is not an overwrite.
    Returns ``path`` as a Path; raises UsageError with the fix.
    """
    if not path:
        raise UsageError("--out is required", "pass the output directory, e.g. --out results/")
    out, spec = _resolve(path), KINDS[kind]
    _check_place(out, path, inputs)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {path} is an existing file, not a directory", "pass a new or empty directory")
    if out.is_dir():
        entries = [e for e in out.iterdir() if not _ignorable(e)]
        complete = spec.marker is not None and (out / spec.marker).is_file()
        foreign = sorted(e.name for e in entries if not spec.owns(e))
        if entries and not complete and foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise UsageError(f"--out {path} is not empty and does not hold {spec.label} ({shown})",
                             "pass a new or empty directory: multitoken never replaces files it did not write")
        if complete and not (overwrite or resume):
            raise UsageError(f"--out {path} already holds {spec.label}",
                             "pass --overwrite to replace it (only its own files are replaced), or choose another --out")
        _probe(out, path)
    _probe(_existing_parent(out, path), path)  # staging dirs are made beside --out
    return Path(path)


def _our_jsonl(path: Path) -> bool:
    """True when ``path`` starts like a ``multitoken distill`` corpus (a JSON object per line
    holding only ``input_ids`` and/or ``text``)."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(1 << 20)
        record = json.loads(first.decode("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and bool(record) and set(record) <= {"input_ids", "text"}


def our_generations(path: Path) -> bool:
    """True when ``path`` starts like ``multitoken generate --prompts`` output (a JSON object per
    line with at least ``prompt``, ``token_ids`` and ``text``)."""
    try:
        with open(path, "rb") as fh:
            record = json.loads(fh.readline(1 << 24).decode("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"prompt", "token_ids", "text"} <= set(record)


def prepare_output_file(path: str | None, *, overwrite: bool = False, inputs=(), sidecars: tuple[str, ...] = (),
                        command: str = "distill") -> Path:
    """The same guard for a command writing one jsonl file (``distill``, ``generate --prompts``):
    an existing file is replaced only with ``--overwrite`` and only if that command wrote it;
    ``sidecars`` (suffixes of files written beside it, e.g. ``.config.json``) must be ours too."""
    ours, what = {"distill": (_our_jsonl, "a corpus"), "generate": (our_generations, "generations")}[command]
    if not path:
        raise UsageError("no output file given", "pass --out FILE.jsonl")
    out = _resolve(path)
    _check_place(out, path, inputs)
    if out.is_dir():
        raise UsageError(f"--out {path} is a directory", "pass a file path ending in .jsonl")
    if out.exists():
        if not overwrite:
            raise UsageError(f"--out {path} exists", "pass --overwrite to replace it, or choose another --out")
        if not ours(out):
            raise UsageError(f"--out {path} exists and is not {what} written by multitoken {command}",
                             "choose another --out: multitoken never replaces files it did not write")
    for suffix in sidecars:
        side = Path(str(out) + suffix)
        if side.exists() and not _json_object(side).get("command") == command:
            raise UsageError(f"{side} exists and was not written by multitoken {command}", "choose another --out")
    _probe(_existing_parent(out, path), path)
    return Path(path)
