"""The catalogue of bad inputs: each thing a user gave mxmoe that once went wrong, and what it must get now (one
line naming the cause, or the behaviour docs/user-guide.md promises under "Failure behaviour"). The next bad input
goes here, under its area.

CLI cases run the installed ``mxmoe`` command in a subprocess (the ``mxmoe_cli`` fixture), as users do; Python
cases call the API. torch.compile cases live with the backend's tests (tests/torch_frontend/test_backend.py,
"bad calls and bad weights"), which share its fixtures.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import mxmoe
from mxmoe.core.checkpoint import read_safetensors, write_hf_gpt_oss, write_safetensors
from mxmoe.core.config import MoEConfig
from mxmoe.core.reference import numpy_reference
from mxmoe.core.signature import TensorSpec
from mxmoe.core.weights import MoEWeights
from mxmoe.runtime import ArtifactError, WeightsError, load
from mxmoe.runtime import artifact as A
from mxmoe.runtime.module import BoundModule
from mxmoe.torch_frontend import MoE

TINY = mxmoe.preset("tiny")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("bad")


@pytest.fixture(scope="module")
def compiled():
    """The tiny layer compiled for the cpu (its ``model`` record names the layer's weights)."""
    return mxmoe.compile(MoE.random("tiny", seed=4), target="cpu")


@pytest.fixture(scope="module")
def art(compiled, work):
    compiled.save(work / "tiny.mxmoe")
    return work / "tiny.mxmoe"


@pytest.fixture(scope="module")
def ckpt(work):
    d = work / "ckpt"
    write_hf_gpt_oss(d, {0: MoEWeights.random(TINY, seed=7)}, float_dtype="bfloat16")
    return d


@pytest.fixture(scope="module")
def ext_art(compiled, work, ckpt):
    """The tiny module with external weights (recorded source: layer 0 of ``ckpt``)."""
    p = work / "ext.mxmoe"
    compiled.save(p, weights="external",
                  external_sources={"layer.0": {"kind": "hf-gpt-oss", "path": str(ckpt), "layer": 0}})
    return p


def _copy_with_flip(src, dst, section: str, at: int):
    """``src`` copied to ``dst`` with one bit of byte ``at`` of ``section`` flipped."""
    raw = bytearray(src.read_bytes())
    raw[A.Artifact(src).section_info(section)["offset"] + at] ^= 0x01
    dst.write_bytes(bytes(raw))
    return dst


def _x(tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, TINY.hidden)).astype(np.float32)


# ======================================================================= empty batches

def test_an_empty_batch_returns_an_empty_output_everywhere(art, compiled):
    """0 tokens (an expert-parallel rank without tokens) is a valid call of every path, and runs nothing."""
    layer = MoE.random("tiny", seed=4)
    mod = load(art)
    y = mod(np.zeros((0, 64), np.float32))
    assert isinstance(y, np.ndarray) and y.shape == (0, 64) and y.dtype.name == "bfloat16"
    t = mod(torch.zeros(0, 64))
    assert isinstance(t, torch.Tensor) and t.shape == (0, 64) and t.dtype == torch.bfloat16
    assert compiled(torch.zeros(0, 64, dtype=torch.bfloat16)).shape == (0, 64)
    assert layer(torch.zeros(0, 64, dtype=torch.bfloat16)).shape == (0, 64)       # the eager reference
    assert layer(torch.zeros(3, 0, 64, dtype=torch.bfloat16)).shape == (3, 0, 64)
    assert numpy_reference(layer.to_weights(), np.zeros((0, 64), np.float32), np.dtype(np.float32)).shape == (0, 64)
    with pytest.raises(ValueError, match=r"input 'x': dim 1 must be 64"):
        mod(np.zeros((0, 65), np.float32))  # empty, but still checked


def test_an_empty_batch_does_not_reach_a_tensor_taking_executor():
    """Triton code takes the tensors itself ([..., H], any leading dims); an empty batch never reaches it."""
    def executor(*args):
        raise AssertionError("the executor ran on an empty batch")

    mod = BoundModule([TensorSpec("x", "bfloat16", (None, 64))], [TensorSpec("out0", "bfloat16", (None, 64))],
                      executor, takes_tensors=True)
    y = mod(torch.zeros(2, 0, 64, dtype=torch.bfloat16))
    assert y.shape == (2, 0, 64) and y.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"input 'x': expected \[\.\.\., 64\]"):
        mod(torch.zeros(0, 63))


def test_run_an_empty_batch(mxmoe_cli, art):
    r = mxmoe_cli("run", art, "--tokens", 0, "--check", "--numpy-reference")
    assert r.rc == 0 and "(0 tokens)" in r.out and "output (0, 64) bfloat16" in r.out and "PASS" in r.out, r.out + r.err


# ======================================================================= artifacts: corrupt, changed, truncated

def test_check_verifies_the_weights_it_compares(mxmoe_cli, art, work):
    """A flipped weight byte reaches the module and the reference alike, so --check hashes the weights first."""
    bad = _copy_with_flip(art, work / "flipped_weight.mxmoe", "weights/default.irpa", 40_000)
    mxmoe_cli("run", bad, "--check").error("corrupt artifact", "section 'weights/default.irpa' checksum mismatch")
    r = mxmoe_cli("run", art, "--check", "--copy", "--numpy-reference")
    assert r.rc == 0 and "weights match their sha256" in r.out and "PASS" in r.out, r.out + r.err


def test_a_flipped_byte_in_the_weight_archive_header_names_the_checksum(mxmoe_cli, art, work):
    """IREE's parser raised an IndexError here, shown as "internal error"."""
    bad = _copy_with_flip(art, work / "flipped_header.mxmoe", "weights/default.irpa", 40)
    mxmoe_cli("run", bad).error("section 'weights/default.irpa' checksum mismatch")


def test_an_artifact_changed_in_place_refuses_to_run(art, work):
    """Overwriting a loaded artifact in place used to change a running module's weights silently."""
    p = work / "overwritten.mxmoe"
    shutil.copy(art, p)
    mapped, copied = load(p), load(p, copy=True)
    x = _x(5)
    before = np.asarray(mapped(x), np.float32)
    info = A.Artifact(p).section_info("weights/default.irpa")
    with open(p, "r+b") as f:
        f.seek(info["offset"] + 1000)
        f.write(bytes(4096))
    with pytest.raises(ArtifactError, match=r"overwritten.mxmoe: the artifact changed on disk since it was loaded "
                                            r"\(written to in place\); load it again$"):
        mapped(x)
    assert np.array_equal(np.asarray(copied(x), np.float32), before)  # copy=True: the file no longer matters


def test_a_truncated_artifact_is_an_error_not_sigbus(art, work):
    """Truncating a loaded artifact killed the process with SIGBUS (in a subprocess: that is what is tested)."""
    p = work / "truncated_later.mxmoe"
    shutil.copy(art, p)
    script = textwrap.dedent(f"""
        import os
        import numpy as np
        from mxmoe.runtime import ArtifactError, load
        mapped, copied = load({str(p)!r}), load({str(p)!r}, copy=True)
        x = np.ones((3, 64), np.float32)
        before = np.asarray(copied(x), np.float32)
        os.truncate({str(p)!r}, 70_000)  # into the weights
        try:
            mapped(x)
            print("ran")
        except ArtifactError as e:
            print(e)
        print("copy unchanged:", np.array_equal(np.asarray(copied(x), np.float32), before))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    lines = r.stdout.strip().splitlines()
    size = os.path.getsize(art)
    assert lines == [f"{p}: the artifact changed on disk since it was loaded (now 70000 bytes, was {size}); "
                     "load it again", "copy unchanged: True"], r.stdout


# ======================================================================= NaN weights

def test_nan_router_weights_are_refused_at_compile_time():
    """The compiled routing picked experts around a NaN logit (finite output) where the reference gives NaN."""
    w = MoEWeights.random(TINY, seed=1)
    w.router_weight[3, 17] = np.nan
    with pytest.raises(ValueError, match=r"^weight 'router_weight' holds nan at index \[3, 17\]; mxmoe refuses NaN "
                                         r"and infinite weights$"):
        mxmoe.compile(MoE(w), target="cpu")


def test_a_checkpoint_with_nan_scales_is_refused(mxmoe_cli, ckpt, ext_art, work):
    """Scale byte 0xFF is NaN in E8M0: refused when compiling, and when binding external weights at load."""
    bad = work / "ckpt_nan_scales"
    bad.mkdir()
    shutil.copy(ckpt / "config.json", bad / "config.json")
    tensors = dict(read_safetensors(ckpt / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = np.full_like(
        tensors["model.layers.0.mlp.experts.down_proj_scales"], 0xFF)
    write_safetensors(bad / "model.safetensors", tensors)
    mxmoe_cli("compile", bad, "--target", "cpu", "-o", work / "nan.mxmoe").error(
        "weight 'w2_scale' holds the scale byte 0xFF (NaN in E8M0) at index [0, 0, 0]")
    assert not (work / "nan.mxmoe").exists()
    with pytest.raises(WeightsError, match=r"weight 'w2_scale' holds the scale byte 0xFF"):
        load(ext_art, weights=bad, layer=0)


# ======================================================================= output paths

def test_a_destination_that_cannot_be_written_is_refused_before_the_compile(mxmoe_cli, work):
    """Each of these returns at once (no compile): none replaces what is there. Only paths in the test's folder:
    the rename the check prevents would replace whatever stands at the path."""
    fifo, sock = work / "a.fifo", work / "a.sock"
    os.mkfifo(fifo)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
    (work / "adir").mkdir()
    for dest, where, words in ((fifo, fifo, "is a FIFO, not a regular file; refusing to replace it"),
                               (sock, sock, "is a socket, not a regular file"),
                               (work / "adir", work / "adir", "is a directory"),
                               (work / "missing" / "x.mxmoe", work / "missing", "output directory does not exist")):
        r = mxmoe_cli("compile", "--preset", "tiny", "--target", "cpu", "-o", dest)
        r.error(f"{where}: ", words)
        assert "building" not in r.err  # refused before any work
    assert fifo.is_fifo() and sock.is_socket()
    mxmoe_cli("run", "--output", fifo, work / "absent.mxmoe").error("is a FIFO")  # before the artifact is opened


def _in_namespace(script: str) -> subprocess.CompletedProcess:
    """``script`` (sh) run in a private user and mount namespace (``unshare -rm``): its mounts need no privileges and
    vanish with it, and a mount point cannot be renamed over, so nothing outside can be replaced."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare with user namespaces")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=600)


def test_a_device_is_refused_not_replaced(art, work):
    """``-o /dev/null`` replaced the device node with the artifact. Tried on a bind mount of /dev/null."""
    dev = work / "device"
    dev.touch()
    exe = os.path.join(os.path.dirname(sys.executable), "mxmoe")
    r = _in_namespace(f"mount --bind /dev/null {dev} && {exe} compile --preset tiny --target cpu -o {dev}; "
                      f"{exe} run {art} --output {dev}")
    assert r.stderr.strip().splitlines() == [
        f"mxmoe: error: {dev}: is a character device, not a regular file; refusing to replace it"] * 2, r.stderr


def test_run_output_writes_exactly_the_path_given_and_follows_symlinks(mxmoe_cli, art, work):
    r = mxmoe_cli("run", art, "--output", work / "y.out", "--tokens", 3, "--repeat", 1)
    assert r.rc == 0 and f"wrote {work / 'y.out'}" in r.out, r.err
    assert np.load(work / "y.out").shape == (3, 64) and not (work / "y.out.npy").exists()
    # a symlink is followed on purpose: its target is replaced, the link stays a link
    (work / "target.npy").write_bytes(b"old")
    (work / "link.npy").symlink_to(work / "target.npy")
    assert mxmoe_cli("run", art, "--output", work / "link.npy", "--tokens", 2, "--repeat", 1).rc == 0
    assert (work / "link.npy").is_symlink() and np.load(work / "target.npy").shape == (2, 64)


def test_a_full_disk_is_one_line_and_leaves_nothing_behind(art, work):
    """It was "internal error" with a weights-sized temporary file left behind each time."""
    d = work / "full"
    d.mkdir()
    exe = os.path.join(os.path.dirname(sys.executable), "mxmoe")
    r = _in_namespace(f"mount -t tmpfs -o size=100k tmpfs {d} && "
                      f"{exe} compile --preset tiny --target cpu -o {d}/x.mxmoe -q; echo rc=$?; "
                      f"{exe} run {art} --tokens 2000 --output {d}/y.npy >/dev/null; echo rc=$?; ls -A {d}")
    assert r.stdout.split() == ["rc=1", "rc=1"], r.stdout + r.stderr  # and `ls` lists nothing
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("mxmoe: error:")]
    assert errors == [f"mxmoe: error: no space left on device writing {d}/x.mxmoe",
                      f"mxmoe: error: no space left on device writing {d}/y.npy"], r.stderr


def test_a_read_only_destination_fails_before_the_compile(work):
    d = work / "ro"
    d.mkdir()
    exe = os.path.join(os.path.dirname(sys.executable), "mxmoe")
    r = _in_namespace(f"mount -t tmpfs -o ro tmpfs {d} && {exe} compile --preset tiny --target cpu -o {d}/x.mxmoe")
    assert r.returncode == 1 and r.stderr.strip() == f"mxmoe: error: {d}: output directory is not writable", r.stderr


# ======================================================================= arguments and configs

@pytest.mark.parametrize("tol", ["-1", "nan", "inf"])
def test_check_tolerance_must_be_finite_and_not_negative(mxmoe_cli, art, tol):
    mxmoe_cli("run", art, "--check", "--tol", tol).error(f"--tol must be a finite number >= 0, got {float(tol)}")


def test_weights_that_are_not_a_checkpoint(mxmoe_cli, ext_art, ckpt):
    """A checkpoint's config.json given as --weights was "corrupt header length ..."."""
    mxmoe_cli("run", ext_art, "--weights", ckpt / "config.json").error(
        f"{ckpt / 'config.json'}: not a safetensors file (its first 8 bytes")


def test_a_checkpoint_layer_that_is_not_there_is_named(mxmoe_cli, ext_art, ckpt):
    """It listed the layer's eight tensors as missing."""
    mxmoe_cli("run", ext_art, "--weights", ckpt, "--layer", 9).error(f"{ckpt}: no MoE layer 9 (MoE layers: 0)")


@pytest.mark.parametrize("field, value", [("swiglu_alpha", float("nan")), ("swiglu_alpha", -1.702),
                                          ("swiglu_limit", 0.0), ("swiglu_limit", float("inf")),
                                          ("swiglu_alpha", "1.702")])
def test_swiglu_alpha_and_limit_must_be_finite_and_positive(field, value):
    """A negative limit compiled to a module that disagreed with the reference; NaN failed inside the compiler."""
    with pytest.raises(ValueError, match=rf"^MoEConfig: {field} must be a finite number > 0, got {value!r}$"):
        TINY.replace(**{field: value})


@pytest.mark.parametrize("field", ["interleaved", "renormalize", "bias", "router_bias"])
def test_config_flags_must_be_bools(field):
    """A string flag got as far as the custom ops' schema checks: a 55-frame traceback."""
    with pytest.raises(ValueError, match=rf"^MoEConfig: {field} must be True or False, got 'no'$"):
        MoEConfig(num_experts=8, top_k=2, hidden=64, intermediate=64, **{field: "no"})


def test_moe_needs_moe_weights():
    """``MoE(dict)`` was an AttributeError from inside the constructor."""
    with pytest.raises(TypeError, match=r"^MoE: expected MoEWeights, got dict \(build them with"):
        MoE({"w13": np.zeros(3)})
    with pytest.raises(TypeError, match=r"^MoE.random: expected a MoEConfig or a preset name, got dict$"):
        MoE.random({"num_experts": 8})
