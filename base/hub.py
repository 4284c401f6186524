"""Where a base model comes from: a local directory, the local Hugging Face cache, or the Hub.

Decided before transformers is asked, so that a mistyped path says "not found" at once and a
Hub id without network fails in a fraction of a second instead of after huggingface_hub's 25 s
of retries: a short connectivity probe first; when the Hub is unreachable, models already in
the local cache load with ``local_files_only`` (no request at all), others fail with one line.
When the Hub answers, loading takes transformers' ordinary path (downloads, revisions).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from pathlib import Path
from urllib.parse import urlparse

from multitoken.base.errors import CheckpointError
from multitoken.embedded import BASE_FORMS, FETCHED_PREFIX, SMOLLM2, fetched_dir

# A Hub repo id: "name" or "owner/name" (letters, digits, '-', '_', '.'), never a path.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
PROBE_TIMEOUT_S = 1.0  # connect timeout; the whole probe (DNS included) waits at most 1.5x this


def looks_like_path(name: str) -> bool:
    """A local path by its spelling ('/', '.', '~' first, several '/', a backslash, not a Hub
    id), or one whose first folder exists here (``runs/model`` beside a ``runs`` dir)."""
    if name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1 or not HUB_ID.fullmatch(name):
        return True
    return "/" in name and Path(name.split("/")[0]).is_dir()


def locate(name: str) -> tuple[str, dict]:
    """``(what to pass to from_pretrained, its extra kwargs)`` for a base model or tokenizer.

    Raises CheckpointError, without touching the network, for a path that does not exist, and
    for a Hub id that is neither cached nor reachable.
    """
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_base(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not (path / "config.json").is_file():
            if len(ggufs) > 1:
                raise CheckpointError(f"{name!r} holds {len(ggufs)} .gguf files and no config.json",
                                      f"pass one of them as --base, e.g. --base {ggufs[0]}")
            return gguf_base(ggufs[0])
        return str(path), {}
    if path.exists():
        raise CheckpointError(f"{name!r} is a file, not a model directory",
                              "pass the directory holding config.json and the *.safetensors weights, or a .gguf file")
    if looks_like_path(name):
        if unfetched := _not_fetched(path):
            raise unfetched
        raise CheckpointError(f"{name!r} not found: no such directory",
                              f"check the path (--base takes {BASE_FORMS})")
    return name, _hub_kwargs(name)


def gguf_base(path: Path) -> tuple[str, dict]:
    """A GGUF file as transformers loads it: its folder plus ``gguf_file``. transformers reads
    it with the ``gguf`` package and dequantizes every tensor to the requested dtype."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise CheckpointError(f"{str(path)!r} is a GGUF file, and reading one needs the gguf package",
                              "pip install 'multitoken[gguf]' (or pip install gguf)")
    return str(path.parent), {"gguf_file": path.name}


@functools.lru_cache(maxsize=None)
def file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file (cached per path, size and mtime: a GGUF base is hashed once)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def _hub_kwargs(repo_id: str) -> dict:
    from huggingface_hub import constants

    offline = offline_reason()
    if offline is None:
        return {}
    if _cached(repo_id):
        return {"local_files_only": True}
    raise CheckpointError(
        f"{repo_id!r} is not a local directory, not in the Hugging Face cache ({constants.HF_HUB_CACHE}), "
        f"and the Hub is unreachable ({offline})",
        offline_names(),
    )


def offline_names() -> str:
    """The fix of a Hub id that cannot be reached: the names that work without the Hub."""
    smollm2 = FETCHED_PREFIX + SMOLLM2
    fetched = "fetched on this machine" if fetched_dir(SMOLLM2).is_dir() else "after `multitoken fetch smollm2`"
    return (f"offline, name a model this machine has: {smollm2} ({fetched}), embedded:stories260K "
            "(shipped in the package) or a local checkpoint dir; online, connect to download it once")


def _not_fetched(path: Path) -> CheckpointError | None:
    """``fetched:NAME`` (resolved to its cache folder) that ``multitoken fetch`` has not made."""
    if path.parent != fetched_dir("x").parent:
        return None
    return CheckpointError(f"{FETCHED_PREFIX}{path.name} is not fetched on this machine (no {path})",
                           f"run `multitoken fetch {path.name}` once (it needs the network), or name another model")


def offline_reason() -> str | None:
    """Why the Hub cannot be used now (HF_HUB_OFFLINE, or the endpoint's probe failed), or None.
    Silences huggingface_hub's retry warnings either way: the caller's one line says it all."""
    from huggingface_hub import constants

    quiet_hub_retries()
    return "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else hub_unreachable(constants.ENDPOINT)


def _cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


@functools.lru_cache(maxsize=None)
def hub_unreachable(endpoint: str) -> str | None:
    """None when a TCP connection to ``endpoint`` opens within the timeout, else why not.

    Runs in a daemon thread so that a hanging DNS lookup (which ignores socket timeouts)
    cannot hold the caller beyond 1.5 x PROBE_TIMEOUT_S. Through an HTTPS proxy, the proxy
    is what must answer.
    """
    import socket
    import urllib.request

    url = urlparse(endpoint)
    proxy = None if urllib.request.proxy_bypass(url.hostname or "") else urllib.request.getproxies().get(url.scheme)
    target = urlparse(proxy if "://" in (proxy or "") else f"http://{proxy}") if proxy else url
    host, port = target.hostname, target.port or (443 if target.scheme == "https" else 80)
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(f"{host}: {err.strerror or type(err).__name__}")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(1.5 * PROBE_TIMEOUT_S)
    return outcome[0] if outcome else f"{host}: no answer in {1.5 * PROBE_TIMEOUT_S:.1f} s"


def quiet_hub_retries() -> None:
    """huggingface_hub logs every retry of a failed request as a warning ("Retrying in 8s"):
    noise for a CLI user, whose one error line says what failed."""
    logging.getLogger("huggingface_hub.utils._http").setLevel(logging.ERROR)


def source_gguf(base: str, hub_kwargs: dict) -> Path | None:
    """The GGUF file behind ``base`` where it is on disk: the file itself, or the one a converted
    checkpoint's ``conversion.json`` names beside it (its codes are read from it: kernels/gguf_file.py)."""
    if "gguf_file" in hub_kwargs:
        return Path(base) / hub_kwargs["gguf_file"]
    record = Path(base) / "conversion.json"
    try:
        name = json.loads(record.read_text()).get("gguf_file") if record.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    path = Path(base) / name if isinstance(name, str) and name == Path(name).name else None
    return path if path is not None and path.is_file() else None


def source_sha256(base: str, hub_kwargs: dict) -> str | None:
    """sha256 of the GGUF file behind ``base``: the file itself, or the one a converted
    checkpoint's ``conversion.json`` names (written by ``multitoken fetch``)."""
    if "gguf_file" in hub_kwargs:
        path = Path(base) / hub_kwargs["gguf_file"]
        st = path.stat()
        return file_sha256(str(path), st.st_size, st.st_mtime_ns)
    record = Path(base) / "conversion.json"
    if record.is_file():
        try:
            return json.loads(record.read_text()).get("gguf_sha256")
        except (ValueError, AttributeError):
            return None
    return None


# Code from a checkpoint never runs: every config, tokenizer and model load passes
# trust_remote_code=False (transformers then never asks on stdin), and a local checkpoint that
# names its own classes (``auto_map``) for a type transformers cannot build is refused first.
CUSTOM_CODE_FIX = ("multitoken never runs code shipped with a checkpoint: use one whose model and tokenizer classes "
                   "transformers provides")


def check_no_custom_code(folder: Path, supported: tuple[str, ...]) -> None:
    """Refuse a local checkpoint whose ``config.json`` maps a ``model_type`` outside
    ``supported`` to its own Python classes (``auto_map``): loading it means running them."""
    try:
        record = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # missing or unreadable: transformers' own error names it
    if isinstance(record, dict) and record.get("auto_map") and record.get("model_type") not in supported:
        modules = sorted({str(v).split(".")[0] for v in _flat(record["auto_map"])})
        raise CheckpointError(f"{folder / 'config.json'}: model_type {record.get('model_type')!r} is defined by code in the "
                              f"checkpoint ({', '.join(m + '.py' for m in modules[:3])}, auto_map): refused, not run",
                              f"multitoken never runs code shipped with a checkpoint: use a checkpoint of a supported type ({', '.join(supported)})")


def _flat(value) -> list:
    if isinstance(value, dict):
        return [v for item in value.values() for v in _flat(item)]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _flat(item)]
    return [value]


def custom_code_error(name: str, err: Exception) -> CheckpointError | None:
    """transformers' refusal to run a checkpoint's code (trust_remote_code=False) as one line."""
    if "trust_remote_code" not in str(err):
        return None
    return CheckpointError(f"{name!r} needs code shipped with the checkpoint to load (custom model or tokenizer "
                           "classes): refused, not run", CUSTOM_CODE_FIX)
