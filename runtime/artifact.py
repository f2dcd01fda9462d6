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
import mmap
import os
import stat
import struct
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Mapping

import numpy as np

from mxmoe.core.bridge import numpy_dtype
from mxmoe.core.files import OutputError, write_atomically
from mxmoe.core.safetensors import SafetensorsView, write_tensors
from mxmoe.runtime.code import KIND_CUBIN, KIND_IRPA, KIND_SAFETENSORS, KIND_VMFB, code_from_record, section_name  # noqa: F401

MAGIC = b"\x89MXMOE\r\n"
FORMAT_VERSION = 1
ALIGNMENT = 4096
HEADER = struct.Struct("<8sIIQQ32s")  # 64 bytes
assert HEADER.size == 64
_MAX_MANIFEST = 64 << 20

#: Section kinds a reader understands (others are kept and listed, never guessed at): the code kinds of
#: ``mxmoe.runtime.code`` and the two weight formats.


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

    The file is written beside ``path`` and renamed into place (``mxmoe.core.files.write_atomically``: the
    destination checked first, the temporary removed on any failure), so a reader never sees half a file and a
    module loaded from the old file keeps its own copy. Returns the manifest as written.
    """
    path = Path(path)
    manifest = dict(manifest)
    manifest.setdefault("format", "mxmoe-artifact")
    manifest["format_version"] = FORMAT_VERSION
    manifest.setdefault("mxmoe_version", _version())
    records = []
    with write_atomically(path) as f:
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
    return manifest


# ============================================================================================ read

class Artifact:
    """An opened artifact: the manifest parsed and checked, sections memory-mapped on demand.

    Opening reads the 64-byte header and the manifest only. ``section(name)`` returns a read-only
    ``memoryview`` into the mapping (no copy). Weight hashes are checked by ``verify()``, not at open
    (hashing gigabytes of weights at every load would cost more than loading them); small sections
    (compiled modules, kernel binaries) are checked when read with ``section_bytes``.

    The file stays open, and the mapping is made from that same open file, so what is mapped is what was checked.
    A mapping reads the file as it is now: ``check_unchanged()`` (one ``fstat``) refuses to go on once the file was
    written to or truncated in place, which would otherwise change a running module's weights or kill the process
    with SIGBUS. A file replaced by rename (how mxmoe writes artifacts) leaves this one's bytes as they were.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # NONBLOCK: a FIFO is refused below, not waited on
        except FileNotFoundError:
            raise ArtifactError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise ArtifactError(f"{self.path}: is a directory, not an mxmoe artifact") from None
        except OSError as e:
            raise ArtifactError(f"{self.path}: cannot open ({e.strerror})") from None
        self._fd = fd
        weakref.finalize(self, os.close, fd)
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ArtifactError(f"{self.path}: is a directory, not an mxmoe artifact")
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{self.path}: not a regular file, not an mxmoe artifact")
        self._stamp = (st.st_size, st.st_mtime_ns)
        self.size = st.st_size
        head = os.pread(fd, HEADER.size, 0)
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
        blob = os.pread(fd, msize, moff)
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

    def check_unchanged(self) -> None:
        """ArtifactError if the file was written to or truncated since it was opened (one ``fstat``, ~1 us)."""
        st = os.fstat(self._fd)
        if (st.st_size, st.st_mtime_ns) != self._stamp:
            what = (f"now {st.st_size} bytes, was {self._stamp[0]}" if st.st_size != self._stamp[0]
                    else "written to in place")
            raise ArtifactError(f"{self.path}: the artifact changed on disk since it was loaded ({what}); "
                                "load it again")

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
        for e in (m["module"].get("entries") or {}).values():  # Triton modules of several entries
            refs += list((e.get("binaries") or {}).values())
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
            self.check_unchanged()
            self._mmap = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ)
        return self._mmap

    def section(self, name: str) -> memoryview:
        """A read-only view of a section's bytes inside the memory-mapped file (no copy)."""
        info = self.section_info(name)
        self.check_unchanged()
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

    def code(self):
        """The compiled code (``mxmoe.runtime.code``), its sections read and checked against their sha256."""
        try:
            return code_from_record(self.manifest["module"], self.target, self.section_bytes)
        except (KeyError, ValueError, TypeError) as e:
            if isinstance(e, ArtifactError):
                raise
            raise self._bad(f"module record: {e}") from None

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


# ================================================================= safetensors weight sections

def safetensors_writer(arrays: Mapping[str, np.ndarray]) -> Callable[[BinaryIO], None]:
    """A section writer for ``arrays`` in the safetensors format (``mxmoe.core.safetensors``)."""
    return lambda f: write_tensors(f, arrays)


def read_safetensors_view(view: memoryview, label: str = "weights") -> dict[str, np.ndarray]:
    """Arrays viewing a safetensors section (read-only, no copy)."""
    try:
        return SafetensorsView(view, label).arrays()
    except ValueError as e:
        raise ArtifactError(str(e)) from None


# ================================================================= IREE parameter archive sections

def irpa_writer(arrays: Mapping[str, np.ndarray], scratch_dir: str | os.PathLike, label: str | None = None) -> str:
    """Write ``arrays`` as an IREE parameter archive in ``scratch_dir``; returns its path (copy it into a
    section, then delete it). Entries carry IREE's tensor metadata (dtype, shape). Nothing is left behind on a
    failure; IREE reports a full disk without its cause, so a failure with less room than the weights need is
    ``OutputError("no space left on device writing LABEL")``."""
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
    try:
        index.create_archive_file(path)
    except Exception:
        os.unlink(path)
        st = os.statvfs(scratch_dir)
        if st.f_bavail * st.f_frsize < sum(a.nbytes for a in keep):
            raise OutputError(f"no space left on device writing {label or path}") from None
        raise
    return path


def irpa_index(view: memoryview):
    """An ``iree.runtime.ParameterIndex`` over an archive section, by reference into the mapping."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    index.load_from_file_handle(rt.FileHandle.wrap_memory(view), "irpa")
    return index


# ================================================================= from a compiled module

def save_module(path: str | os.PathLike, *, target: dict, code, entries, parameter_specs,
                parameters: Mapping[str, np.ndarray] | None = None, stored_forms: Mapping | None = None,
                weights: str = "embedded",
                weight_sets: Mapping[str, Callable[[], Mapping[str, np.ndarray]]] | None = None,
                external_sources: Mapping[str, dict] | None = None, model: dict | None = None,
                source: dict | None = None, timings: Mapping[str, float] | None = None,
                progress: Callable[[str], None] | None = None, shard: dict | None = None,
                extra_sections: Iterable[Section] = ()) -> dict:
    """Write a compiled module as an artifact; the one writer of compiled code (``mxmoe.compile``'s modules and
    the torch.compile cache both come here). Returns the manifest.

    ``target`` is the target's manifest record, ``code`` an ``IreeCode`` or ``TritonCode``, ``entries`` its entry
    points (``EntrySignature``s, the default first), ``parameter_specs`` each parameter's stored name, dtype and shape (``TensorSpec``s),
    ``parameters`` the stored arrays by name (the default weight set) and ``stored_forms`` how each was made from
    its logical array.
    ``weights="embedded"`` stores the weights in the target's layout: by default one set, ``default``, from
    ``parameters``; ``weight_sets`` (name -> callable giving *logical* arrays by parameter name, e.g. one per
    checkpoint layer) stores several, each put through the parameter's stored form. ``weights="external"`` stores
    none: ``external_sources`` (set name -> where to find the raw weights, e.g. ``{"kind": "hf-gpt-oss", "path":
    ..., "layer": 3}``) is recorded, and the runtime applies the stored forms at load time. ``weights="none"``
    stores none and names no source: the caller binds weights itself (the torch.compile cache). ``model``
    describes the layer for reference checks (``mxmoe.core.weights.moe_model_info``). ``shard`` marks the
    artifact as the parts of a layer cut over ranks (one weight set per rank, ``rank.R``; docs/distributed.md),
    ``extra_sections`` are written after the module's (e.g. the sharded layer's replicated router).
    """
    if weights not in ("embedded", "external", "none"):
        raise ValueError(f"weights must be 'embedded', 'external' or 'none', got {weights!r}")
    forms = dict(stored_forms or {})
    params = [{"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape),
               "form": forms[spec.name].to_dict() if spec.name in forms else None} for spec in parameter_specs]
    dtypes = {p["name"]: numpy_dtype(p["dtype"]) for p in params}
    sections = [Section(c.name, c.kind, c.data) for c in code.sections()] + list(extra_sections)
    wformat = code.weights_format
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
            want = dtypes[p["name"]]
            if a.dtype != want:
                a = a.astype(want)
            out[p["name"]] = forms[p["name"]].apply(p["name"], a) if p["name"] in forms else a
        return out

    def _set_writer(set_name, getter):
        def write(f) -> None:
            if getter is None and parameters is None:
                raise ValueError("weights='embedded' needs the parameters' arrays")
            arrays = parameters if getter is None else stored(getter)
            if progress:
                progress(f"packing weights '{set_name}'")
            if wformat != KIND_IRPA:
                safetensors_writer(arrays)(f)
                return
            p = irpa_writer(arrays, scratch, str(path))
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
                sec = f"weights/{section_name(set_name)}" + (".irpa" if wformat == KIND_IRPA else ".safetensors")
                # Each set is built, transformed and written when its section's turn comes, then dropped:
                # a whole checkpoint never sits in memory (or in scratch files) at once.
                sections.append(Section(sec, wformat, _set_writer(set_name, getter)))
                sets.append({"name": set_name, "section": sec,
                             "source": (external_sources or {}).get(set_name)})
        elif weights == "external":
            for set_name, src in (external_sources or {"default": None}).items():
                sets.append({"name": set_name, "section": None, "source": src})
        manifest = {
            "format": "mxmoe-artifact",
            "mxmoe_version": _version(),
            "target": dict(target),
            "module": code.record(),
            "entries": [e.to_dict() for e in entries],
            "parameters": params,
            "weights": {"storage": weights, "format": wformat, "parameter_scope": "model",
                        "default": sets[0]["name"] if sets else None, "sets": sets},
            "model": model,
            "source": source,
            "compile_timings": {k: round(float(v), 4) for k, v in (timings or {}).items()},
        }
        if shard is not None:
            manifest["shard"] = dict(shard)
        return write_artifact(path, manifest, sections, progress=progress)
    finally:
        for p in tmp_files:
            if os.path.exists(p):
                os.unlink(p)
