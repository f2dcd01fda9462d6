"""On-disk cache of modules the torch.compile backend compiled, so a second process starts fast.

An entry is one file, ``<root>/<key[:2]>/<key>.mxmoe``::

    b"MXMOE-CACHE\\n" | 8-byte little-endian manifest length | manifest (JSON) | payload (compiled module)

The manifest records the key, the format version, what the payload is (entry signature, parameter
names) and the payload's SHA-256. The key is the SHA-256 of everything the compiled module depends on:
the region's graph structure, its inputs' dtypes/shapes/roles (weights by shape and dtype only, never by
value: weights are bound at load time), the target, mxmoe's version and a fingerprint of the compiler's
source files, and the iree-compiler, triton and torch versions. A file that does not parse, whose key or format
does not match, or whose payload hash is wrong is corrupt: it is deleted and reported as a miss, so the
caller rebuilds it; it is never used. Writes go to a temporary file that is renamed into place, so a
crash or a concurrent writer never leaves a half-written entry under the final name.

Location: ``$MXMOE_CACHE_DIR`` if set (``MXMOE_CACHE_DIR=off`` disables the cache), else
``$XDG_CACHE_HOME/mxmoe``, else ``~/.cache/mxmoe``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mxmoe.core.host import cache_root

MAGIC = b"MXMOE-CACHE\n"
FORMAT = 1
_LEN = struct.Struct("<Q")


#: The layers whose sources decide what a compiled region is: the compiler, the kernels it plans and builds
#: (Triton sources and the cpu microkernel's C), core (layouts, config) and this frontend (ops, capture, the
#: backend). Every .py and .c file of them goes into the key, so an edited kernel or pass is a new key even
#: while the package version stays the same. The runtime is left out: it does not change a compiled module.
_SOURCES = ("mxmoe.core", "mxmoe.kernels", "mxmoe.compiler", "mxmoe.torch_frontend")


@functools.cache
def _source_fingerprint() -> str:
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

    return {"mxmoe": __version__, "mxmoe_sources": _source_fingerprint(),
            "iree_compiler": ver("iree-base-compiler"), "iree_runtime": ver("iree-base-runtime"),
            "triton": ver("triton"), "torch": torch.__version__}


def make_key(material: dict[str, Any]) -> str:
    """SHA-256 (hex) of ``material`` plus :func:`environment`, as canonical JSON."""
    blob = json.dumps({"format": FORMAT, "env": environment(), **material}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class Entry:
    manifest: dict[str, Any]
    payload: bytes


class CorruptEntry(Exception):
    pass


class CompileCache:
    """Get/put compiled payloads by key under ``root`` (None: a cache that stores nothing)."""

    def __init__(self, root: Optional[os.PathLike | str] = None):
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

    def get(self, key: str) -> Optional[Entry]:
        """The entry for ``key``, or None (absent, disabled, or corrupt: a corrupt file is deleted)."""
        if self.root is None:
            return None
        p = self.path(key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"mxmoe cache: cannot read {p} ({e}); recompiling", stacklevel=2)
            return None
        try:
            return _decode(data, key)
        except CorruptEntry as e:
            self.corrupt_seen += 1
            warnings.warn(f"mxmoe cache: corrupt entry {p} ({e}); deleting it and recompiling", stacklevel=2)
            try:
                p.unlink()
            except OSError:
                pass
            return None

    def put(self, key: str, manifest: dict[str, Any], payload: bytes) -> Optional[Path]:
        """Store atomically; returns the path, or None when disabled or the folder is not writable."""
        if self.root is None:
            return None
        p = self.path(key)
        man = {**manifest, "key": key, "format": FORMAT, "payload_sha256": hashlib.sha256(payload).hexdigest(),
               "payload_bytes": len(payload)}
        blob = json.dumps(man, sort_keys=True).encode()
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-", suffix=".mxmoe")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(MAGIC + _LEN.pack(len(blob)) + blob + payload)
                os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a cache entry is not a secret
                os.replace(tmp, p)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
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


def _decode(data: bytes, key: str) -> Entry:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LEN.size:
        raise CorruptEntry("bad header")
    (n,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if start + n > len(data):
        raise CorruptEntry("truncated manifest")
    try:
        man = json.loads(data[start:start + n])
    except ValueError:
        raise CorruptEntry("manifest is not JSON") from None
    if not isinstance(man, dict) or man.get("key") != key or man.get("format") != FORMAT:
        raise CorruptEntry("key or format mismatch")
    payload = data[start + n:]
    if len(payload) != man.get("payload_bytes") or hashlib.sha256(payload).hexdigest() != man.get("payload_sha256"):
        raise CorruptEntry("payload hash mismatch")
    return Entry(man, payload)
