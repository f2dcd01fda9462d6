"""The artifact container (mxmoe.runtime.artifact): layout, hashes and every way a file can be bad.

No compiler here: these build small artifacts by hand, so they run in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import struct

import ml_dtypes
import numpy as np
import pytest

from mxmoe.runtime import artifact as A


def _manifest(**extra) -> dict:
    m = {
        "target": {"name": "cpu", "backend": "iree", "arch": "host"},
        "module": {"kind": A.KIND_VMFB, "section": "module.vmfb"},
        "entries": [{"name": "main", "inputs": [{"name": "x", "dtype": "bfloat16", "shape": [None, 64]}],
                     "outputs": [{"name": "out0", "dtype": "bfloat16", "shape": [None, 64]}]}],
        "parameters": [],
        "weights": {"storage": "embedded", "format": A.KIND_SAFETENSORS, "default": "default",
                    "sets": [{"name": "default", "section": "weights/default.safetensors"}]},
    }
    m.update(extra)
    return m


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    return {"w13": rng.integers(0, 256, (4, 6, 16), dtype=np.uint8),
            "bias": rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16),
            "router": rng.standard_normal((4, 32)).astype(np.float32),
            "empty": np.zeros((0, 3), np.float32)}


@pytest.fixture
def art_path(tmp_path, arrays):
    src = tmp_path / "blob.bin"
    src.write_bytes(b"streamed from a file" * 1000)
    p = tmp_path / "m.mxmoe"
    A.write_artifact(p, _manifest(), [
        A.Section("module.vmfb", A.KIND_VMFB, b"\x01\x02vmfb-bytes"),
        A.Section("weights/default.safetensors", A.KIND_SAFETENSORS, A.safetensors_writer(arrays)),
        A.Section("binary/extra", "binary", src),
    ])
    return p


def test_round_trip_layout_and_hashes(art_path, arrays, tmp_path):
    art = A.Artifact(art_path)
    raw = art_path.read_bytes()
    assert raw[:8] == A.MAGIC
    magic, version, flags, moff, msize, mhash = A.HEADER.unpack(raw[:64])
    assert version == A.FORMAT_VERSION == art.version and flags == 0
    assert hashlib.sha256(raw[moff: moff + msize]).digest() == mhash
    assert moff + msize == len(raw)  # manifest is the tail
    m = art.manifest
    assert m["format"] == "mxmoe-artifact" and m["format_version"] == 1 and m["mxmoe_version"]
    prev_end = 64
    for s in m["sections"]:
        assert s["offset"] % A.ALIGNMENT == 0 and s["offset"] >= prev_end
        assert hashlib.sha256(raw[s["offset"]: s["offset"] + s["size"]]).hexdigest() == s["sha256"]
        prev_end = s["offset"] + s["size"]
    assert art.section_bytes("module.vmfb") == b"\x01\x02vmfb-bytes"
    assert bytes(art.section("binary/extra")) == (tmp_path / "blob.bin").read_bytes()
    art.verify()
    got = A.read_safetensors_view(art.section("weights/default.safetensors"))
    assert set(got) == set(arrays)
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype and got[k].shape == a.shape
        np.testing.assert_array_equal(got[k].view(np.uint8) if a.size else got[k], a.view(np.uint8) if a.size else a)


def test_weight_arrays_are_views_of_the_mapping(art_path):
    """Weights are read in place from the memory-mapped file, never copied at open."""
    art = A.Artifact(art_path)
    got = A.read_safetensors_view(art.section("weights/default.safetensors"))
    mapping = np.frombuffer(art._map(), dtype=np.uint8)
    assert np.shares_memory(got["w13"], mapping)
    assert not got["w13"].flags.writeable


def test_safetensors_section_is_readable_by_safetensors(tmp_path, arrays):
    """The weight blob is the real safetensors format (other tools can read an extracted section)."""
    from safetensors.numpy import load_file

    w = A.safetensors_writer({k: v for k, v in arrays.items() if k != "bias"})
    p = tmp_path / "x.safetensors"
    with open(p, "wb") as f:
        w(f)
    got = load_file(str(p))
    np.testing.assert_array_equal(got["w13"], arrays["w13"])
    np.testing.assert_array_equal(got["router"], arrays["router"])


def test_irpa_section_round_trip(tmp_path, arrays):
    p = A.irpa_writer({k: v for k, v in arrays.items() if v.size}, tmp_path)
    art_p = tmp_path / "i.mxmoe"
    man = _manifest()
    man["weights"] = {"storage": "embedded", "format": A.KIND_IRPA, "sets": [{"name": "default", "section": "w.irpa"}]}
    A.write_artifact(art_p, man, [A.Section("module.vmfb", A.KIND_VMFB, b"x"), A.Section("w.irpa", A.KIND_IRPA, p)])
    art = A.Artifact(art_p)
    index = A.irpa_index(art.section("w.irpa"))
    entries = dict(index.items())
    for k in ("w13", "bias", "router"):
        np.testing.assert_array_equal(np.frombuffer(entries[k].file_view, np.uint8), arrays[k].reshape(-1).view(np.uint8))


def test_missing_file(tmp_path):
    with pytest.raises(A.ArtifactError, match="no such file"):
        A.Artifact(tmp_path / "nope.mxmoe")


def test_not_an_artifact(tmp_path):
    p = tmp_path / "x.mxmoe"
    p.write_text("hello, I am text")
    with pytest.raises(A.ArtifactError, match="not an mxmoe artifact"):
        A.Artifact(p)


@pytest.mark.parametrize("keep", [8, 40, -10, -200])
def test_truncated(art_path, keep):
    raw = art_path.read_bytes()
    art_path.write_bytes(raw[:keep])
    with pytest.raises(A.ArtifactError, match="truncated"):
        A.Artifact(art_path)


def test_truncated_section_detected_from_manifest(tmp_path, art_path):
    """A file cut inside a section (manifest moved to still be readable) names the section."""
    art = A.Artifact(art_path)
    man = dict(art.manifest)
    sec = man["sections"][-1]
    sec = dict(sec, size=sec["size"] + 10 * A.ALIGNMENT)
    man["sections"] = man["sections"][:-1] + [sec]
    raw = art_path.read_bytes()
    blob = json.dumps(man).encode()
    moff = len(raw)
    art_path.write_bytes(A.HEADER.pack(A.MAGIC, 1, 0, moff, len(blob), hashlib.sha256(blob).digest()) + raw[64:] + blob)
    with pytest.raises(A.ArtifactError, match="truncated artifact \\(section 'binary/extra'"):
        A.Artifact(art_path)


def test_corrupt_manifest_byte(art_path):
    raw = bytearray(art_path.read_bytes())
    moff = A.HEADER.unpack(bytes(raw[:64]))[3]
    raw[moff + 5] ^= 0x20
    art_path.write_bytes(bytes(raw))
    with pytest.raises(A.ArtifactError, match="corrupt artifact \\(manifest checksum mismatch\\)"):
        A.Artifact(art_path)


def test_corrupt_section_byte(art_path):
    art = A.Artifact(art_path)
    off = art.section_info("module.vmfb")["offset"]
    wo = art.section_info("weights/default.safetensors")["offset"]
    raw = bytearray(art_path.read_bytes())
    raw[off] ^= 0xFF
    raw[wo + 100] ^= 0xFF
    art_path.write_bytes(bytes(raw))
    art = A.Artifact(art_path)  # opening checks the header and manifest only
    with pytest.raises(A.ArtifactError, match="section 'module.vmfb' checksum mismatch"):
        art.section_bytes("module.vmfb")
    with pytest.raises(A.ArtifactError, match="section 'weights/default.safetensors' checksum mismatch"):
        art.verify(["weights/default.safetensors"])


def test_newer_format_version(art_path):
    raw = bytearray(art_path.read_bytes())
    struct.pack_into("<I", raw, 8, A.FORMAT_VERSION + 1)
    art_path.write_bytes(bytes(raw))
    with pytest.raises(A.ArtifactError, match="format version 2 is newer than this mxmoe"):
        A.Artifact(art_path)


@pytest.mark.parametrize("drop", ["entries", "target", "weights"])
def test_manifest_missing_keys(tmp_path, drop):
    man = _manifest()
    del man[drop]
    p = tmp_path / "m.mxmoe"
    A.write_artifact(p, man, [A.Section("module.vmfb", A.KIND_VMFB, b"x")])
    with pytest.raises(A.ArtifactError, match=f"missing '{drop}'"):
        A.Artifact(p)


def test_manifest_refers_to_absent_section(tmp_path):
    p = tmp_path / "m.mxmoe"
    A.write_artifact(p, _manifest(), [A.Section("module.vmfb", A.KIND_VMFB, b"x")])
    with pytest.raises(A.ArtifactError, match="section 'weights/default.safetensors', which is not in the file"):
        A.Artifact(p)


def test_failed_write_leaves_no_file(tmp_path):
    def boom(f):
        f.write(b"partial")
        raise RuntimeError("disk full")

    p = tmp_path / "m.mxmoe"
    with pytest.raises(RuntimeError, match="disk full"):
        A.write_artifact(p, _manifest(), [A.Section("module.vmfb", A.KIND_VMFB, boom)])
    assert list(tmp_path.iterdir()) == []


def test_written_file_has_normal_permissions(art_path):
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert art_path.stat().st_mode & 0o777 == 0o666 & ~umask
