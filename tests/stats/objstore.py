"""A test object store: fsspec protocol ``mtobj``, backed by a local dir (``mtobj:///abs/dir``),
with what an object store lacks taken away: no rename or move (a put is the only way to make an
object, whole), and no local path to open or memory-map outside fsspec. Registered in the
driver by the tests and in Ray workers by ray_hooks.install."""

from __future__ import annotations

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "mtobj"


class ObjectStoreFS(LocalFileSystem):
    protocol = (PROTOCOL,)
    root_marker = "/"

    def __init__(self, **kwargs):
        super().__init__(**{**kwargs, "auto_mkdir": True})  # objects need no parent "dirs"

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:]
        return super()._strip_protocol(path)

    def mv(self, *args, **kwargs):
        raise NotImplementedError("an object store has no rename")

    rename = move = mv

    def open(self, path, mode="rb", **kwargs):
        if "r" not in mode and "w" not in mode:
            raise NotImplementedError(f"an object store opens objects to read or to write whole, not {mode!r}")
        return super().open(path, mode, **kwargs)


def register() -> None:
    fsspec.register_implementation(PROTOCOL, ObjectStoreFS, clobber=True)
