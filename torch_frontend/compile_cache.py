"""On-disk cache of modules the torch.compile backend compiled, so a second process starts fast.

An entry is an mxmoe artifact without weights (``docs/artifact-format.md``, ``weights.storage = "none"``), at
``<root>/<key[:2]>/<key>.mxmoe``: written by the same writer as ``mxmoe compile``'s artifacts and read back by the
same reader, with the key in its manifest's ``source.cache_key``. The key is the SHA-256 of everything the
compiled module depends on: the region's graph structure, its inputs' dtypes/shapes/roles (weights by shape and
dtype only, never by value: weights are bound at load time), the target, mxmoe's version and a fingerprint of
every source file of the layers that make compiled code (core, kernels, compiler, this frontend), and the
iree-compiler, triton and torch versions. A file that is not a whole artifact, whose key does not match, or one
of whose sections fails its SHA-256 is corrupt: it is deleted and reported as a miss, so the caller rebuilds it;
it is never used. The artifact writer writes a temporary file and renames it into place, so a crash or a
concurrent writer never leaves a half-written entry under the final name.

Location: ``$MXMOE_CACHE_DIR`` if set (``MXMOE_CACHE_DIR=off`` disables the cache), else
``$XDG_CACHE_HOME/mxmoe``, else ``~/.cache/mxmoe``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from mxmoe.core.host import cache_root
from mxmoe.runtime.artifact import Artifact, ArtifactError

FORMAT = 2

#: The layers whose sources decide what a compiled region is: the compiler, the kernels it plans and builds
#: (Triton sources and the cpu microkernel's C), core (layouts, config) and this frontend (ops, capture, the
#: backend). Every .py and .c file of them goes into the key, so an edited kernel or pass is a new key even
#: while the package version stays the same. The runtime is left out: it does not change a compiled module.
_SOURCES = ("mxmoe.core", "mxmoe.kernels", "mxmoe.compiler", "mxmoe.torch_frontend")


@functools.cache
def source_fingerprint() -> str:
    """SHA-256 over the sources in ``_SOURCES``: a changed pass is a new key, even while the package version
    stays the same during development."""
    import importlib

    h = hashlib.sha256()
    for pkg in _SOURCES:
        root = Path(importlib.import_module(pkg).__file__).parent
        for p in sorted(q for pattern in ("**/*.py", "**/*.c") for q in root.glob(pattern)):
            h.update(f"{pkg}/{p.relative_to(root)}".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@functools.cache
def environment() -> dict[str, str]:
    """Versions that go into every key."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from mxmoe.core._version import __version__

    def ver(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "absent"

    return {"mxmoe": __version__, "mxmoe_sources": source_fingerprint(),
            "iree_compiler": ver("iree-base-compiler"), "iree_runtime": ver("iree-base-runtime"),
            "triton": ver("triton"), "torch": torch.__version__}


def make_key(material: dict[str, Any]) -> str:
    """SHA-256 (hex) of ``material`` plus :func:`environment`, as canonical JSON."""
    blob = json.dumps({"format": FORMAT, "env": environment(), **material}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class CompileCache:
    """Get/put compiled modules (artifacts without weights) by key under ``root`` (None: a cache that stores
    nothing)."""

    def __init__(self, root: Optional[Path | str] = None):
        self.root = Path(root).expanduser() if root is not None else None
        self.corrupt_seen = 0

    @classmethod
    def from_env(cls) -> "CompileCache":
        return cls(cache_root())

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def path(self, key: str) -> Path:
        if self.root is None:
            raise RuntimeError("mxmoe cache is disabled")
        return self.root / key[:2] / f"{key}.mxmoe"

    def get(self, key: str) -> Optional[Artifact]:
        """The entry for ``key``, opened and checked (every section's SHA-256), or None: absent, disabled, or
        corrupt (a corrupt file is deleted)."""
        if self.root is None:
            return None
        p = self.path(key)
        if not p.exists():
            return None
        try:
            art = Artifact(p)
            if (art.manifest.get("source") or {}).get("cache_key") != key:
                raise ArtifactError("key mismatch")
            art.verify()
            return art
        except ArtifactError as e:
            self.corrupt_seen += 1
            warnings.warn(f"mxmoe cache: corrupt entry {p} ({e}); deleting it and recompiling", stacklevel=2)
            try:
                p.unlink()
            except OSError:
                pass
            return None
        except OSError as e:
            warnings.warn(f"mxmoe cache: cannot read {p} ({e}); recompiling", stacklevel=2)
            return None

    def put(self, key: str, write: Callable[[Path, dict], Any]) -> Optional[Path]:
        """Store an entry: ``write(path, source)`` writes the artifact (its manifest's ``source`` must be
        ``source``, which carries the key). Returns the path, or None when disabled or not writable."""
        if self.root is None:
            return None
        p = self.path(key)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            write(p, {"kind": "torch.compile region", "cache_key": key, "cache_format": FORMAT})
        except OSError as e:
            warnings.warn(f"mxmoe cache: cannot write {p} ({e}); continuing without caching", stacklevel=2)
            return None
        return p

    def clear(self) -> int:
        """Delete every entry; returns how many."""
        if self.root is None or not self.root.exists():
            return 0
        n = 0
        for p in self.root.glob("*/*.mxmoe"):
            p.unlink(missing_ok=True)
            n += 1
        return n
