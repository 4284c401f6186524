"""Output guards: every command that writes checks its destination before any work.

``claim_output(path, kind, overwrite=..., inputs=...)`` (``claim_file`` for one file) is
entered at the very start of a command's run, before a model or a corpus is loaded, and held
to its end: it checks the destination, then takes the output's lock (a second run on the same
output is refused at once, naming the first). The rules:

- the destination is new, an empty directory, or holds an output of this kind whose record
  (``manifest``) lists its files; the latter only with ``--overwrite`` (or when the command
  resumes its own job there). A name match is never ownership: a directory holding files but no
  record is refused (an output of an older multitoken too: move it away or delete it), and so is
  an entry the record does not list that bears a name the command writes, or a listed file that
  changed since (replaced, a symlink, another size);
- never ``.``, the home directory, ``/``, an input or a parent of an input, an existing file
  (for commands writing a directory);
- the place is probed: a temp file is created, written, synced and removed, so read-only,
  full or not-a-directory destinations fail now.

Writing itself goes through ``publish`` (staged, then swapped in all or nothing).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from multitoken.base.atomic import output_lock
from multitoken.base.errors import UsageError
from multitoken.base.manifest import MANIFEST, read_record, sidecar, still_ours, top_names, work_dir_ours

PROBE_BYTES = 4096
MIN_FREE_BYTES = 1 << 20


@dataclass(frozen=True)
class OutputKind:
    """What one command writes: the kind its record names, and the entry names it may write."""

    kind: str                           # the record's "kind"
    label: str                          # "a heads dir", for messages
    marker: str | None                  # the file readers take as "complete"
    names: tuple[str, ...] = ()         # entry names (fnmatch) the command may write

    def may_write(self, name: str) -> bool:
        return name == MANIFEST or any(fnmatch.fnmatchcase(name, p) for p in self.names)


HEADS = OutputKind("heads", "a heads dir", "heads_config.json",
                   ("heads_config.json", "heads.safetensors", "lora", "attach_config.json",
                    "train_config.json", "train_metrics.json", "rank_accuracy.json", "draft_vocab.json",
                    "import_config.json"))
STATS = OutputKind("stats", "a stats dir", "meta.json",
                   ("meta.json", "config.json", "counts[0-9].npy", "keys[0-9].npy", "partials", "merge-parts"))
STATS_WORK = OutputKind("stats-work", "a stats work dir", None, ("partials", "merge-parts"))
EVAL = OutputKind("eval", "an eval report", "report.json", ("report.json", "eval_config.json", "logit_lens.png", "rank_accuracy.json"))
SWEEP = OutputKind("sweep", "a sweep", "sweep.json", ("sweep.json", "sweep.csv", "sweep.png", "sweep_config.json"))
CONVERTED = OutputKind("convert", "a converted model", "conversion.json",
                       ("conversion.json", "config.json", "generation_config.json", "model.safetensors",
                        "tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                        "added_tokens.json"))
CHECKPOINTS = OutputKind("checkpoints", "training checkpoints", None, ("step-[0-9]*",))
CORPUS = OutputKind("corpus", "a corpus written by multitoken distill", None)
GENERATIONS = OutputKind("generations", "generations written by multitoken generate", None)
# No marker: every multitoken that writes this kind records it, and a bare config.json is anyone's
# (the export still publishes its config.json last: export_medusa.write_medusa).
MEDUSA_EXPORT = OutputKind("medusa-export", "a Medusa export (multitoken export --format medusa)", None,
                           ("config.json", "model.safetensors", "README.md", "LICENSE"))
EAGLE3_EXPORT = OutputKind("eagle3-export", "an EAGLE-3 export (multitoken export --format eagle3)", None,
                           ("config.json", "model.safetensors", "README.md", "LICENSE"))
RECIPE = OutputKind("recipe", "a heads build (multitoken build-heads)", None, ("distill", "heads-*", "report"))
KINDS = {k.kind: k for k in (HEADS, STATS, STATS_WORK, EVAL, SWEEP, CONVERTED, CHECKPOINTS, CORPUS, GENERATIONS, RECIPE,
                                   MEDUSA_EXPORT, EAGLE3_EXPORT)}
FILE_KINDS = {"distill": CORPUS, "generate": GENERATIONS}  # single-file outputs, by command
CONFIG_SUFFIX = ".config.json"  # the resolved config beside a single-file output


def add_overwrite_flag(parser) -> None:
    """``--overwrite``: the same flag with the same meaning on every command that writes."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output of this command in --out (only the files its record lists; others stay)")


def _resolve(path: str) -> Path:
    return Path(os.path.abspath(Path(path).expanduser()))


def _check_place(out: Path, shown: str, inputs) -> None:
    """Never the current dir, the home dir, the root, an input or a parent of an input."""
    real = out.resolve()
    specials = {Path.cwd().resolve(): "the current directory", Path.home().resolve(): "your home directory",
                Path(real.anchor): "the root directory"}
    if real in specials:
        raise UsageError(f"{shown} is {specials[real]}", "pass a new directory for the output, e.g. --out results/")
    for spec in inputs:
        if not spec:
            continue
        head = str(spec).split("*")[0].split("?")[0].split("[")[0]  # the fixed part of a glob
        inp = _resolve(head).resolve() if head else None
        if inp is None:
            continue
        if real == inp or real in inp.parents:
            what = "the input" if real == inp else "a parent of the input"
            raise UsageError(f"{shown} is {what} {spec}", "write the output somewhere else: it must not hold the inputs")


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
        raise UsageError(f"cannot write to {place} (for {shown}): {err.strerror or err}", fix) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
        raise UsageError(f"no space left on the disk of {shown} ({place}: {st.f_bavail * st.f_frsize} bytes free)", fix)


def _existing_parent(out: Path, shown: str) -> Path:
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{shown}: {parent} is a file, not a directory", "pass a path whose parents are directories")
    return parent


def _refuse_unrecorded(out: Path, shown: str, spec: OutputKind, entries: list[Path]) -> None:
    if spec.marker is not None and (out / spec.marker).is_file():
        raise UsageError(f"{shown} holds {spec.label} with no record of its files ({MANIFEST}: an older "
                         "multitoken wrote it)", "move it away or delete it, then rerun")
    names = sorted(e.name for e in entries)
    shown_names = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    raise UsageError(f"{shown} is not empty and does not hold {spec.label} written by multitoken ({shown_names})",
                     "pass a new or empty directory: multitoken never replaces files it did not write")


def _refuse_strangers(out: Path, shown: str, spec: OutputKind, record: dict, entries: list[Path], replacing: bool) -> None:
    """Entries bearing our names that the record does not list, and (when ``replacing``) listed
    ones that changed: a resumed job reads those and says what is wrong with them, and its
    publish leaves them alone."""
    covered = top_names(record) | {MANIFEST}
    strangers = sorted(e.name for e in entries if e.name not in covered and spec.may_write(e.name))
    changed = sorted([rel for rel, e in record["files"].items()
                      if os.path.lexists(out / rel) and not still_ours(out, rel, e)] +
                     [w for w in record["work"] if os.path.lexists(out / w) and not work_dir_ours(out, w)])
    if strangers:
        raise UsageError(f"{shown} holds {', '.join(strangers[:3])}, which multitoken has no record of writing",
                         "move it away (multitoken never replaces files it did not write), then rerun")
    if changed and replacing:
        raise UsageError(f"{shown}: {changed[0]} changed since multitoken wrote it (its record lists another file)",
                         "move it away (multitoken never replaces files it did not write), then rerun")


def _check_existing(out: Path, shown: str, spec: OutputKind, overwrite: bool, resume: bool) -> None:
    entries = list(out.iterdir())
    if not entries:
        return
    record = read_record(out / MANIFEST, shown)
    if record is None:
        _refuse_unrecorded(out, shown, spec, entries)
    if record["kind"] != spec.kind:
        other = KINDS[record["kind"]].label if record["kind"] in KINDS else record["kind"]
        raise UsageError(f"{shown} holds {other}, not {spec.label}", "pass another --out")
    if not (overwrite or resume):
        raise UsageError(f"{shown} already holds {spec.label}",
                         "pass --overwrite to replace it (only the files its record lists are replaced), or choose another --out")
    # a resumed training reads its checkpoints (and names a damaged one) rather than replacing them
    _refuse_strangers(out, shown, spec, record, entries, replacing=overwrite or spec is not CHECKPOINTS)


def prepare_output(path: str | None, kind: str, *, overwrite: bool = False, inputs=(), resume: bool = False,
                   flag: str = "--out") -> Path:
    """Check ``path`` as the output directory of a ``kind`` command (see the module doc).

    ``resume``: the command continues its own interrupted or finished job there (it checks that
    the job is the same itself), so an existing output of this kind is not an overwrite.
    ``flag`` names the option in messages. Returns ``path`` as a Path; raises UsageError with the fix.
    """
    if not path:
        raise UsageError(f"{flag} is required", f"pass the output directory, e.g. {flag} results/")
    out, spec, shown = _resolve(path), KINDS[kind], f"{flag} {path}"
    _check_place(out, shown, inputs)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{shown} is an existing file, not a directory", "pass a new or empty directory")
    if out.is_dir():
        _check_existing(out, shown, spec, overwrite, resume)
        _probe(out, shown)
    _probe(_existing_parent(out, shown), shown)  # staging dirs are made beside it
    return Path(path)


def prepare_output_file(path: str | None, *, overwrite: bool = False, inputs=(), command: str = "distill") -> Path:
    """The same guard for a command writing one file (``distill``, ``generate --out``): its
    record is ``FILE.multitoken.json`` beside it (listing FILE and FILE.config.json); an existing
    file is replaced only with ``--overwrite`` and only if such a record of this command lists it."""
    spec = FILE_KINDS[command]
    if not path:
        raise UsageError("no output file given", "pass --out FILE.jsonl")
    out = _resolve(path)
    _check_place(out, f"--out {path}", inputs)
    if out.is_dir():
        raise UsageError(f"--out {path} is a directory", "pass a file path ending in .jsonl")
    ours = (out.name, out.name + CONFIG_SUFFIX)
    present = [n for n in ours if os.path.lexists(out.parent / n)]
    record = read_record(sidecar(out), f"--out {path}") if out.parent.is_dir() else None
    if record is None and present:
        raise UsageError(f"--out {path}: {present[0]} exists and is not {spec.label} (no record {sidecar(out).name} beside it)",
                         "choose another --out, or move that file away or delete it: multitoken never replaces files it did not write")
    if record is not None:
        if record["kind"] != spec.kind:
            raise UsageError(f"--out {path} holds {KINDS.get(record['kind'], spec).label}, not {spec.label}", "choose another --out")
        if not overwrite:
            raise UsageError(f"--out {path} exists", "pass --overwrite to replace it, or choose another --out")
        strangers = [n for n in present if n not in record["files"] or not still_ours(out.parent, n, record["files"][n])]
        if strangers:
            raise UsageError(f"--out {path}: {strangers[0]} is not the file multitoken {command} wrote (its record lists another)",
                             "choose another --out, or move that file away: multitoken never replaces files it did not write")
    _probe(_existing_parent(out, f"--out {path}"), f"--out {path}")
    return Path(path)


@contextlib.contextmanager
def _claimed(path: str | None, label: str, check):
    """Check, take the output's lock, and check again under it (a run that finished meanwhile
    is seen); the lock is held until the block ends, whatever way it ends."""
    check()
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(output_lock(path, f"{path} ({label})"))
        except OSError as err:
            raise UsageError(f"cannot write beside --out {path}: {err.strerror or err}",
                             "pass an --out on a writable disk with free space") from None
        yield check()


def claim_output(path: str | None, kind: str, *, overwrite: bool = False, inputs=(), resume: bool = False,
                 flag: str = "--out"):
    """``prepare_output`` under the output's lock, held for the ``with`` block; yields the path."""
    return _claimed(path, KINDS[kind].label,
                    lambda: prepare_output(path, kind, overwrite=overwrite, inputs=inputs, resume=resume, flag=flag))


def claim_file(path: str | None, command: str, *, overwrite: bool = False, inputs=()):
    """``prepare_output_file`` under the file's lock, held for the ``with`` block; yields the path."""
    return _claimed(path, FILE_KINDS[command].label,
                    lambda: prepare_output_file(path, overwrite=overwrite, inputs=inputs, command=command))
