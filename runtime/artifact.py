"""The mxmoe artifact: one versioned file holding a compiled module, its manifest and its weights.

No torch, no compiler: this module only reads and writes bytes. ``docs/artifact-format.md`` is the
specification; in short::

    offset 0    header, 64 bytes (little-endian)
                  magic            8 bytes  b"\\x89MXMOE\\r\\n"
                  format_version   u32      FORMAT_VERSION
                  flags            u32      0 (reserved)
                  manifest_offset  u64
                  manifest_size    u64
                  manifest_sha256  32 bytes
    ...         sections, each starting at a multiple of ALIGNMENT (4096) bytes, zero padding between
    ...         manifest: UTF-8 JSON, after the last section

Sections are raw bytes named in the manifest (``module.vmfb``, ``weights/<set>.irpa``,
``binary/<kernel>.cubin``, ``weights/<set>.safetensors``...), each with its offset, size and sha256.
Because sections are page-aligned and stored uncompressed, a reader memory-maps the file and hands
a weights section to IREE (or numpy) as a view: nothing is copied at open.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Mapping

import numpy as np

from mxmoe.core.host import cpu_features

MAGIC = b"\x89MXMOE\r\n"
FORMAT_VERSION = 1
ALIGNMENT = 4096
HEADER = struct.Struct("<8sIIQQ32s")  # 64 bytes
assert HEADER.size == 64
_MAX_MANIFEST = 64 << 20

#: Section kinds a reader understands (others are kept and listed, never guessed at).
KIND_VMFB = "iree-vmfb"
KIND_IRPA = "iree-parameter-archive"
KIND_SAFETENSORS = "safetensors"
KIND_CUBIN = "cubin"
KIND_BINARY = "binary"


class ArtifactError(ValueError):
    """The file is not a usable mxmoe artifact (missing, not one, corrupt, truncated, too new...)."""


def _version() -> str:
    from mxmoe.core._version import __version__

    return __version__


# ============================================================================================ write

@dataclass
class Section:
    """One section to write: ``data`` is bytes, a path to a file whose bytes are copied (streamed),
    or a callable ``write(fileobj)`` that writes the bytes itself."""

    name: str
    kind: str
    data: bytes | os.PathLike | str | Callable[[BinaryIO], None]


class _HashingWriter:
    def __init__(self, f: BinaryIO):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        self.f.write(mv)
        self.h.update(mv)
        self.n += len(mv)
        return len(mv)


def write_artifact(path: str | os.PathLike, manifest: dict, sections: Iterable[Section],
                   progress: Callable[[str], None] | None = None) -> dict:
    """Write ``sections`` and ``manifest`` (sections' offsets/sizes/hashes are added) to ``path``.

    The file is written beside ``path`` and renamed into place, so a reader never sees half a file.
    Returns the manifest as written.
    """
    path = Path(path)
    manifest = dict(manifest)
    manifest.setdefault("format", "mxmoe-artifact")
    manifest["format_version"] = FORMAT_VERSION
    manifest.setdefault("mxmoe_version", _version())
    records = []
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".partial", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * HEADER.size)
            for s in sections:
                if any(r["name"] == s.name for r in records):
                    raise ValueError(f"duplicate artifact section name {s.name!r}")
                if progress:
                    progress(f"writing {s.name}")
                pad = -f.tell() % ALIGNMENT
                f.write(b"\0" * pad)
                offset = f.tell()
                w = _HashingWriter(f)
                if isinstance(s.data, (bytes, bytearray, memoryview)):
                    w.write(s.data)
                elif isinstance(s.data, (str, os.PathLike)):
                    with open(s.data, "rb") as src:
                        while chunk := src.read(16 << 20):
                            w.write(chunk)
                else:
                    s.data(w)
                records.append({"name": s.name, "kind": s.kind, "offset": offset, "size": w.n,
                                "sha256": w.h.hexdigest()})
            manifest["sections"] = records
            blob = json.dumps(manifest, indent=1, sort_keys=False).encode("utf-8")
            moff = f.tell()
            f.write(blob)
            f.seek(0)
            f.write(HEADER.pack(MAGIC, FORMAT_VERSION, 0, moff, len(blob), hashlib.sha256(blob).digest()))
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private; give it the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return manifest


# ============================================================================================ read

class Artifact:
    """An opened artifact: the manifest parsed and checked, sections memory-mapped on demand.

    Opening reads the 64-byte header and the manifest only. ``section(name)`` returns a read-only
    ``memoryview`` into the mapping (no copy). Weight hashes are checked by ``verify()``, not at open
    (hashing gigabytes of weights at every load would cost more than loading them); small sections
    (compiled modules, kernel binaries) are checked when read with ``section_bytes``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise ArtifactError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise ArtifactError(f"{self.path}: is a directory, not an mxmoe artifact")
        self.size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(HEADER.size)
            if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
                raise ArtifactError(f"{self.path}: not an mxmoe artifact (bad magic bytes)")
            if len(head) < HEADER.size:
                raise ArtifactError(f"{self.path}: truncated artifact ({self.size} bytes, shorter than the header)")
            _, version, _flags, moff, msize, mhash = HEADER.unpack(head)
            if version > FORMAT_VERSION:
                raise ArtifactError(f"{self.path}: artifact format version {version} is newer than this mxmoe "
                                    f"({_version()}) reads (up to {FORMAT_VERSION}); upgrade mxmoe")
            if version < 1:
                raise ArtifactError(f"{self.path}: corrupt artifact (format version {version})")
            if msize > _MAX_MANIFEST or moff < HEADER.size:
                raise ArtifactError(f"{self.path}: corrupt artifact header (manifest at {moff}, {msize} bytes)")
            if moff + msize > self.size:
                raise ArtifactError(f"{self.path}: truncated artifact (manifest ends at byte {moff + msize}, "
                                    f"file has {self.size})")
            f.seek(moff)
            blob = f.read(msize)
        if hashlib.sha256(blob).digest() != mhash:
            raise ArtifactError(f"{self.path}: corrupt artifact (manifest checksum mismatch)")
        try:
            manifest = json.loads(blob.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ArtifactError(f"{self.path}: corrupt artifact (manifest is not JSON: {e})") from None
        self.version = version
        self.manifest = manifest
        self._validate()
        self._sections = {s["name"]: s for s in manifest["sections"]}
        self._mmap: mmap.mmap | None = None

    # ---------------------------------------------------------------------------------- checks
    def _bad(self, what: str) -> ArtifactError:
        return ArtifactError(f"{self.path}: corrupt artifact manifest ({what})")

    def _validate(self) -> None:
        m = self.manifest
        if not isinstance(m, dict):
            raise self._bad("not a JSON object")
        for key in ("format_version", "target", "entries", "sections", "module", "weights", "parameters"):
            if key not in m:
                raise self._bad(f"missing '{key}'")
        if m.get("format") != "mxmoe-artifact":
            raise self._bad(f"format is {m.get('format')!r}, expected 'mxmoe-artifact'")
        if not isinstance(m["target"], dict) or not {"name", "backend", "arch"} <= set(m["target"]):
            raise self._bad("target needs name, backend and arch")
        if not isinstance(m["entries"], list) or not m["entries"]:
            raise self._bad("no entry points")
        for e in m["entries"]:
            if not isinstance(e, dict) or not {"name", "inputs", "outputs"} <= set(e):
                raise self._bad("an entry point lacks name/inputs/outputs")
        end = HEADER.size
        for s in m["sections"]:
            if not isinstance(s, dict) or not {"name", "kind", "offset", "size", "sha256"} <= set(s):
                raise self._bad("a section lacks name/kind/offset/size/sha256")
            if s["offset"] < end or s["offset"] % ALIGNMENT:
                raise self._bad(f"section {s['name']!r} at bad offset {s['offset']}")
            end = s["offset"] + s["size"]
            if end > self.size:
                raise ArtifactError(f"{self.path}: truncated artifact (section {s['name']!r} ends at byte {end}, "
                                    f"file has {self.size})")
        names = {s["name"] for s in m["sections"]}
        for ref in self._referenced_sections():
            if ref not in names:
                raise self._bad(f"refers to section {ref!r}, which is not in the file")

    def _referenced_sections(self) -> list[str]:
        m = self.manifest
        refs = []
        if m["module"].get("section"):
            refs.append(m["module"]["section"])
        refs += list((m["module"].get("binaries") or {}).values())
        refs += [ws["section"] for ws in m["weights"].get("sets", []) if ws.get("section")]
        return refs

    # ---------------------------------------------------------------------------------- access
    @property
    def section_names(self) -> list[str]:
        return list(self._sections)

    def section_info(self, name: str) -> dict:
        if name not in self._sections:
            raise ArtifactError(f"{self.path}: no section {name!r} (has: {', '.join(self._sections)})")
        return self._sections[name]

    def _map(self) -> mmap.mmap:
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mmap

    def section(self, name: str) -> memoryview:
        """A read-only view of a section's bytes inside the memory-mapped file (no copy)."""
        info = self.section_info(name)
        if info["size"] == 0:
            return memoryview(b"")
        return memoryview(self._map())[info["offset"]: info["offset"] + info["size"]]

    def section_bytes(self, name: str, verify: bool = True) -> bytes:
        """A section's bytes (a copy, for small sections), checked against its sha256."""
        data = bytes(self.section(name))
        if verify and hashlib.sha256(data).hexdigest() != self.section_info(name)["sha256"]:
            raise ArtifactError(f"{self.path}: corrupt artifact (section {name!r} checksum mismatch)")
        return data

    def verify(self, names: Iterable[str] | None = None) -> None:
        """Check the sha256 of the named sections (default: all); ArtifactError names the first bad one."""
        for name in (self._sections if names is None else names):
            h = hashlib.sha256()
            view = self.section(name)
            for start in range(0, len(view), 64 << 20):
                h.update(view[start: start + (64 << 20)])
            if h.hexdigest() != self.section_info(name)["sha256"]:
                raise ArtifactError(f"{self.path}: corrupt artifact (section {name!r} checksum mismatch)")

    # ---------------------------------------------------------------------------------- manifest views
    @property
    def target(self) -> dict:
        return self.manifest["target"]

    def entry(self, name: str | None = None) -> dict:
        entries = self.manifest["entries"]
        if name is None:
            return entries[0]
        for e in entries:
            if e["name"] == name:
                return e
        raise ArtifactError(f"{self.path}: no entry point {name!r} (has: {', '.join(e['name'] for e in entries)})")

    def weight_set(self, name: str | None = None) -> dict:
        w = self.manifest["weights"]
        sets = w.get("sets", [])
        if name is None:
            name = w.get("default") or (sets[0]["name"] if sets else None)
        for s in sets:
            if s["name"] == name:
                return s
        have = ", ".join(s["name"] for s in sets) or "none"
        raise ArtifactError(f"{self.path}: no weight set {name!r} (has: {have})")


# ================================================================= safetensors-like weight sections

_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "uint8": "U8", "int8": "I8",
              "int32": "I32", "int64": "I64"}


def safetensors_writer(arrays: Mapping[str, np.ndarray]) -> Callable[[BinaryIO], None]:
    """A section writer for ``arrays`` in the safetensors format (8-byte header length, JSON header
    padded to 8 bytes, then each tensor's bytes at an offset aligned to 64 bytes)."""
    header, offset, order = {}, 0, []
    for name, a in arrays.items():
        if a.dtype.name not in _ST_DTYPES:
            raise ValueError(f"weight '{name}': dtype {a.dtype} cannot be stored")
        offset += -offset % 64
        header[name] = {"dtype": _ST_DTYPES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        order.append((name, offset))
        offset += a.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-(8 + len(blob)) % 64)

    def write(f) -> None:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        pos = 0
        for name, off in order:
            f.write(b"\0" * (off - pos))
            a = np.ascontiguousarray(arrays[name])
            f.write(a.reshape(-1).view(np.uint8) if a.size else b"")
            pos = off + a.nbytes

    return write


def read_safetensors_view(view: memoryview, label: str = "weights") -> dict[str, np.ndarray]:
    """Arrays viewing a safetensors section (read-only, no copy)."""
    from mxmoe.core.bridge import numpy_dtype

    inv = {v: k for k, v in _ST_DTYPES.items()}
    if len(view) < 8:
        raise ArtifactError(f"{label}: truncated safetensors section")
    n = struct.unpack("<Q", view[:8])[0]
    if 8 + n > len(view):
        raise ArtifactError(f"{label}: corrupt safetensors header length {n}")
    try:
        header = json.loads(bytes(view[8: 8 + n]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{label}: corrupt safetensors header ({e})") from None
    out = {}
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = numpy_dtype(inv[info["dtype"]])
        b, e = info["data_offsets"]
        if base + e > len(view) or e - b != math.prod(info["shape"]) * dt.itemsize:
            raise ArtifactError(f"{label}: corrupt safetensors entry {name!r}")
        out[name] = np.frombuffer(view, dtype=dt, count=math.prod(info["shape"]), offset=base + b).reshape(info["shape"])
    return out


# ================================================================= IREE parameter archive sections

def irpa_writer(arrays: Mapping[str, np.ndarray], scratch_dir: str | os.PathLike) -> str:
    """Write ``arrays`` as an IREE parameter archive in ``scratch_dir``; returns its path (copy it into a
    section, then delete it). Entries carry IREE's tensor metadata (dtype, shape)."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    keep = []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        keep.append(a)
        if a.dtype.name == "bfloat16":
            # IREE's numpy helper does not know ml_dtypes' bfloat16: store raw bytes (metadata is ours).
            index.add_buffer(name, a.reshape(-1).view(np.uint8) if a.size else a.tobytes())
        else:
            rt.parameter_index_add_numpy_ndarray(index, name, a)
    fd, path = tempfile.mkstemp(suffix=".irpa", dir=scratch_dir)
    os.close(fd)
    index.create_archive_file(path)
    return path


def irpa_index(view: memoryview):
    """An ``iree.runtime.ParameterIndex`` over an archive section, by reference into the mapping."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    index.load_from_file_handle(rt.FileHandle.wrap_memory(view), "irpa")
    return index


# ================================================================= from a compiled module

def _section_name(s: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in s)


def _stored_dtype_of(compiled, name: str) -> np.dtype:
    return np.asarray(compiled.parameters[name]).dtype


def save_compiled(compiled, path: str | os.PathLike, *, weights: str = "embedded",
                  weight_sets: Mapping[str, Callable[[], Mapping[str, np.ndarray]]] | None = None,
                  external_sources: Mapping[str, dict] | None = None, model: dict | None = None,
                  source: dict | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Write a compiled module (``mxmoe.compiler.api.CompiledModule`` or anything with its fields) as an artifact.

    ``weights="embedded"`` stores the weights in the target's layout: by default one set, ``default``,
    from ``compiled.parameters``; ``weight_sets`` (name -> callable giving *logical* arrays by parameter
    name, e.g. one per checkpoint layer) stores several, each put through the parameter's stored form.
    ``weights="external"`` stores none: ``external_sources`` (set name -> where to find the raw weights,
    e.g. ``{"kind": "hf-gpt-oss", "path": ..., "layer": 3}``) is recorded, and the runtime applies the
    stored forms at load time. ``model`` describes the layer for reference checks (``{"kind": "moe",
    "config": MoEConfig dict, "parameters": {field: parameter name}}``).
    """
    if weights not in ("embedded", "external"):
        raise ValueError(f"weights must be 'embedded' or 'external', got {weights!r}")
    tgt = compiled.target
    forms = getattr(compiled, "stored_forms", None) or {}
    params = []
    for name, a in compiled.parameters.items():
        a = np.asarray(a)
        form = forms.get(name)
        params.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape),
                       "form": form.to_dict() if form is not None else None})
    target = {"name": tgt.name, "backend": tgt.backend, "arch": tgt.arch, "layout": getattr(getattr(tgt, "layout", None), "name", None)}
    if tgt.backend == "iree" and tgt.arch == "host":
        target["cpu_features"] = cpu_features()
        from mxmoe.kernels.cpu import MATVEC_SYMBOL

        # the C microkernel is linked into the module, whose MLIR calls it by this symbol
        target["cpu_microkernel"] = MATVEC_SYMBOL in (getattr(compiled, "mlir", "") or "")
    sections: list[Section] = []
    if tgt.backend == "iree":
        module = {"kind": KIND_VMFB, "section": "module.vmfb", "function": "main"}
        sections.append(Section("module.vmfb", KIND_VMFB, bytes(compiled.vmfb)))
        wformat = KIND_IRPA
    else:
        binaries = dict(getattr(compiled, "binaries", None) or {})
        module = {"kind": "triton", "kernel_plan": getattr(compiled, "kernel_plan", None),
                  "binaries": {k: f"binary/{_section_name(k)}" for k in binaries}}
        for k, blob in binaries.items():
            sections.append(Section(f"binary/{_section_name(k)}", KIND_CUBIN if tgt.arch.startswith("sm_") else KIND_BINARY,
                                    bytes(blob)))
        wformat = KIND_SAFETENSORS

    sets = []
    scratch = Path(path).parent if str(Path(path).parent) else Path(".")
    tmp_files: list[str] = []

    def stored(getter) -> dict[str, np.ndarray]:
        raw = dict(getter())
        missing = [p["name"] for p in params if p["name"] not in raw]
        if missing:
            raise ValueError(f"weight set lacks parameters: {', '.join(missing)}")
        out = {}
        for p in params:
            a = np.asarray(raw[p["name"]])
            want = np.dtype(compiled.parameters[p["name"]].dtype)
            if a.dtype != want:
                a = a.astype(want)
            out[p["name"]] = forms[p["name"]].apply(p["name"], a) if p["name"] in forms else a
        return out

    def _set_writer(set_name, getter, wformat):
        def write(f) -> None:
            arrays = compiled.parameters if getter is None else stored(getter)
            if progress:
                progress(f"packing weights '{set_name}'")
            if wformat != KIND_IRPA:
                safetensors_writer(arrays)(f)
                return
            p = irpa_writer(arrays, scratch)
            tmp_files.append(p)
            del arrays
            with open(p, "rb") as src:
                while chunk := src.read(16 << 20):
                    f.write(chunk)
            os.unlink(p)
        return write

    try:
        if weights == "embedded":
            getters = dict(weight_sets) if weight_sets else {"default": None}
            for set_name, getter in getters.items():
                sec = f"weights/{_section_name(set_name)}" + (".irpa" if wformat == KIND_IRPA else ".safetensors")
                # Each set is built, transformed and written when its section's turn comes, then dropped:
                # a whole checkpoint never sits in memory (or in scratch files) at once.
                sections.append(Section(sec, KIND_IRPA if wformat == KIND_IRPA else KIND_SAFETENSORS,
                                        _set_writer(set_name, getter, wformat)))
                sets.append({"name": set_name, "section": sec,
                             "source": (external_sources or {}).get(set_name)})
        else:
            for set_name, src in (external_sources or {"default": None}).items():
                sets.append({"name": set_name, "section": None, "source": src})
        manifest = {
            "format": "mxmoe-artifact",
            "mxmoe_version": _version(),
            "target": target,
            "module": module,
            "entries": [{"name": "main", "inputs": [s.to_dict() for s in compiled.inputs],
                         "outputs": [s.to_dict() for s in compiled.outputs]}],
            "parameters": params,
            "weights": {"storage": weights, "format": wformat, "parameter_scope": "model",
                        "default": sets[0]["name"] if sets else None, "sets": sets},
            "model": model if model is not None else getattr(compiled, "model", None),
            "source": source,
            "compile_timings": {k: round(float(v), 4) for k, v in (getattr(compiled, "timings", None) or {}).items()},
        }
        return write_artifact(path, manifest, sections, progress=progress)
    finally:
        for p in tmp_files:
            if os.path.exists(p):
                os.unlink(p)
