"""The mxmoe command line: compile from every kind of SOURCE, run --check, inspect, and the error exits.

Most commands run in-process through ``mxmoe.cli.main`` (fast). What depends on a fresh process's imports runs the
installed console script in a subprocess (the ``mxmoe_cli`` fixture), as users do: the test process has the custom
ops registered and torch loaded, which once hid that ``run --reference`` could not load a ``.pt2``. Bad inputs of
every kind, through the console script, are in tests/test_bad_inputs.py. Each compile happens once per module
(fixtures); numerics are checked by ``run --check``, which compares with the reference MoE computed from the
artifact's own weights, or directly against the source module.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import mxmoe
import mxmoe.compiler.targets
from mxmoe.core.checkpoint import write_hf_gpt_oss
from mxmoe.cli import EXIT_MISMATCH, main
from mxmoe.runtime import artifact as A
from mxmoe.torch_frontend import MoE, capture
from mxmoe.core.weights import MoEWeights


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, *words):
    assert rc != 0
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("mxmoe: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def tiny_art(work):
    p = work / "tiny.mxmoe"
    assert main(["compile", "--preset", "tiny", "--target", "cpu", "-o", str(p), "--seed", "5", "-q"]) == 0
    return p


@pytest.fixture(scope="module")
def ckpt(work):
    cfg = mxmoe.preset("tiny")
    layers = {0: MoEWeights.random(cfg, seed=30), 2: MoEWeights.random(cfg, seed=32)}
    d = work / "ckpt"
    write_hf_gpt_oss(d, layers, float_dtype="bfloat16")
    return d, layers


# ----------------------------------------------------------------------------------------- basics

def test_version_and_help_console_script():
    exe = Path(sys.executable).with_name("mxmoe")
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"mxmoe {mxmoe.__version__}"
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for word in ("compile", "run", "inspect"):
        assert word in r.stdout


@pytest.mark.parametrize("sub", ["compile", "run", "inspect"])
def test_subcommand_help(capsys, sub):
    with pytest.raises(SystemExit) as e:
        main([sub, "--help"])
    assert e.value.code == 0
    assert f"usage: mxmoe {sub}" in capsys.readouterr().out


def test_compile_summary_and_inspect(capsys, tiny_art):
    rc, out, _ = cli(capsys, "compile", "--preset", "tiny", "--target", "cpu", "-o", tiny_art.with_name("t2.mxmoe"))
    assert rc == 0
    assert "compiled MoE layer (E=8, k=2, H=64, I=96) [random tiny, seed 0] for cpu" in out
    assert "wrote" in out and "KB" in out
    rc, out, _ = cli(capsys, "inspect", tiny_art, "--verify")
    assert rc == 0
    for s in ("target      cpu (backend iree, arch host)", "MoE: 8 experts, top-2, hidden 64, intermediate 96",
              "layer(x: bfloat16[?, 64]) -> out0: bfloat16[?, 64]", "weights/default.irpa", "module.vmfb",
              f"layout {mxmoe.compiler.targets.get_target('cpu').layout_for('bf16').name}", "verified"):
        assert s in out, s
    rc, out, _ = cli(capsys, "inspect", tiny_art, "--json")
    assert rc == 0 and json.loads(out)["target"]["name"] == "cpu"


@pytest.mark.parametrize("tokens", [1, 40])
def test_run_check_passes(capsys, tiny_art, tokens):
    rc, out, _ = cli(capsys, "run", tiny_art, "--tokens", tokens, "--check")
    assert rc == 0, out
    assert f"({tokens} tokens)" in out and "vs the torch reference" in out and "PASS" in out


def test_run_check_numpy_reference_and_files(capsys, tiny_art, work):
    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    np.save(work / "x.npy", x)
    rc, out, _ = cli(capsys, "run", tiny_art, "--input", work / "x.npy", "--output", work / "y.npy", "--check",
                     "--numpy-reference")
    assert rc == 0 and "numpy reference" in out and "PASS" in out
    y = np.load(work / "y.npy").astype(np.float32)
    ref = MoE.random("tiny", seed=5)(torch.from_numpy(x).to(torch.bfloat16)).float().numpy()
    assert np.abs(y - ref).max() / np.abs(ref).max() < 2e-2


def test_run_check_fails_when_module_and_reference_disagree(capsys, tiny_art, work):
    """--check can fail: an artifact whose recorded layer config differs from what was compiled."""
    bad = work / "lying.mxmoe"
    a = A.Artifact(tiny_art)
    man = dict(a.manifest)
    man["model"] = {**man["model"], "config": {**man["model"]["config"], "swiglu_limit": 0.5, "top_k": 1}}
    A.write_artifact(bad, man, [A.Section(s["name"], s["kind"], bytes(a.section(s["name"]))) for s in man["sections"]])
    rc, out, _ = cli(capsys, "run", bad, "--tokens", 16, "--check")
    assert rc == EXIT_MISMATCH and "FAIL" in out


def test_run_check_uses_the_reference_of_the_recorded_activations(capsys, tiny_art, work):
    """A w4a8 artifact (target activations "mxfp8") is checked against the reference that rounds the activations
    to MXFP8 as its GEMMs do, and inspect says so. Shown with the cpu module (bf16 activations) under a manifest
    that claims mxfp8: the two now disagree by MXFP8's error (~5%), so the check fails; with the bf16 reference
    it would pass."""
    claimed = work / "claims_mxfp8.mxmoe"
    a = A.Artifact(tiny_art)
    man = dict(a.manifest)
    man["target"] = {**man["target"], "activations": "mxfp8"}
    A.write_artifact(claimed, man, [A.Section(s["name"], s["kind"], bytes(a.section(s["name"])))
                                    for s in man["sections"]])
    rc, out, _ = cli(capsys, "inspect", claimed)
    assert rc == 0 and "activations mxfp8 (w4a8" in out
    rc, out, _ = cli(capsys, "run", claimed, "--tokens", 16, "--check")
    assert rc == EXIT_MISMATCH and "numpy (MXFP8 activations) reference" in out and "FAIL" in out
    rc, out, _ = cli(capsys, "run", tiny_art, "--tokens", 16, "--check")
    assert rc == 0 and "torch reference" in out


@pytest.mark.parametrize("form,says", [("mxint8", "MXINT8"), ("mxint16", "15-bit integer")])
def test_cpu_int8_form_artifacts_are_checked_against_their_reference(capsys, work, form, says):
    """compile --activations mxint8 / mxint16 on cpu records the form; run --check compares with the reference that
    rounds the activations as the module does (it matches it to bf16 rounding) and inspect says so; a bad value is
    one line."""
    from mxmoe.kernels.cpu import matvec_object

    if matvec_object().path is None:
        pytest.skip(f"no cpu microkernel here: {matvec_object().reason}")
    p = work / f"tiny_{form}.mxmoe"
    assert main(["compile", "--preset", "tiny", "--target", "cpu", "--activations", form, "-o", str(p), "--seed",
                 "5", "-q"]) == 0
    assert A.Artifact(p).manifest["target"]["activations"] == form
    assert A.Artifact(p).manifest["target"]["layout"] == "cpu-mxfp4-rows16"
    rc, out, _ = cli(capsys, "inspect", p)
    assert rc == 0 and f"activations {form} (the expert GEMMs read {says}" in out
    rc, out, _ = cli(capsys, "run", p, "--tokens", 9, "--check")
    assert rc == 0 and f"numpy ({form.upper()} activations) reference" in out, out
    rc, _, err = cli(capsys, "compile", "--preset", "tiny", "--target", "rocm:gfx942", "--activations", form,
                     "-o", str(work / "no.mxmoe"), "-q")
    assert_one_line_error(rc, err, "activations must be one of bf16, mxfp8")


def test_run_check_folds_the_reference_as_the_sm90_w4a8_form_does():
    from mxmoe.cli import reference_fold

    assert reference_fold({"name": "cuda:sm_90", "activations": "mxfp8"}) == "row"
    for t in ({"name": "cuda:sm_100", "activations": "mxfp8"}, {"name": "rocm:gfx950", "activations": "mxfp8"},
              {"name": "cuda:sm_90"}, {"name": "cpu"}):
        assert reference_fold(t) == "block", t


# ----------------------------------------------------------------------------------------- sources

def test_compile_checkpoint_all_layers(capsys, ckpt, work):
    d, layers = ckpt
    p = work / "all.mxmoe"
    rc, out, err = cli(capsys, "compile", d, "--target", "cpu", "-o", p)
    assert rc == 0, err
    assert "2 set(s)" in out
    man = A.Artifact(p).manifest
    assert [s["name"] for s in man["weights"]["sets"]] == ["layer.0", "layer.2"]
    for name in ("layer.0", "layer.2"):
        rc, out, _ = cli(capsys, "run", p, "--weight-set", name, "--tokens", 9, "--check")
        assert rc == 0 and "PASS" in out
    rc, out, _ = cli(capsys, "run", p, "--layer", 2, "--tokens", 9, "--check")  # --layer N picks set layer.N
    assert rc == 0 and "PASS" in out
    rc, _, err = cli(capsys, "run", p, "--layer", 5)
    assert_one_line_error(rc, err, "no weight set 'layer.5' (has: layer.0, layer.2)")
    rc, out, _ = cli(capsys, "inspect", p)
    assert "2 set(s): layer.0, layer.2 (default layer.0)" in out
    # the check really uses layer 2's weights: compare with them directly
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    np.save(work / "x2.npy", x)
    rc, _, _ = cli(capsys, "run", p, "--layer", "2", "--input", work / "x2.npy", "--output", work / "y2.npy")
    ref = MoE(layers[2])(torch.from_numpy(x).to(torch.bfloat16)).float().numpy()
    y = np.load(work / "y2.npy").astype(np.float32)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 2e-2


def test_compile_checkpoint_layer_with_external_weights(capsys, ckpt, work):
    d, _ = ckpt
    p = work / "ext.mxmoe"
    rc, out, err = cli(capsys, "compile", d, "--layer", 2, "--weights", "external", "--target", "cpu", "-o", p)
    assert rc == 0, err
    assert "external" in out and p.stat().st_size < 300_000  # the module alone: ~240 KB
    rc, out, _ = cli(capsys, "run", p, "--check")
    assert rc == 0 and "PASS" in out
    rc, out, _ = cli(capsys, "run", p, "--weights", d, "--layer", 0, "--check")
    assert rc == 0 and "PASS" in out
    rc, out, _ = cli(capsys, "inspect", p)
    assert "weights     external" in out and "'layer': 2" in out


def test_compile_exported_program(capsys, work, mxmoe_cli):
    layer = MoE.random("tiny", seed=8)
    ep = capture(layer, torch.randn(4, 64).to(torch.bfloat16))
    src = work / "layer.pt2"
    torch.export.save(ep, str(src))
    p = work / "ep.mxmoe"
    rc, out, err = cli(capsys, "compile", src, "--target", "cpu", "-o", p)
    assert rc == 0, err
    assert "MoE layer (E=8, k=2, H=64, I=96)" in out  # recognised as a bare MoE layer
    rc, out, err = cli(capsys, "run", p, "--check")
    assert rc == 0 and "torch reference" in out and "PASS" in out
    r = mxmoe_cli("run", p, "--tokens", 12, "--check", "--reference", src)  # a fresh process loads the .pt2
    assert r.rc == 0 and "exported-program" in r.out and "PASS" in r.out, r.out + r.err


def test_compile_factory(capsys, work, monkeypatch, mxmoe_cli):
    (work / "my_block.py").write_text(textwrap.dedent("""
        import torch
        from mxmoe.torch_frontend import MoE

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.moe = MoE.random("tiny", seed=9)
            def forward(self, x):
                return x + self.moe(x)

        def make():
            return Block(), (torch.randn(3, 64).to(torch.bfloat16),)
    """))
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    p = work / "block.mxmoe"
    rc, out, err = cli(capsys, "compile", "my_block:make", "--target", "cpu", "-o", p)
    assert rc == 0, err
    import my_block

    x = np.random.default_rng(2).standard_normal((7, 64)).astype(np.float32)
    np.save(work / "xb.npy", x)
    rc, _, err = cli(capsys, "run", p, "--input", work / "xb.npy", "--output", work / "yb.npy")
    assert rc == 0, err
    ref = my_block.make()[0](torch.from_numpy(x).to(torch.bfloat16)).float().numpy()
    y = np.load(work / "yb.npy").astype(np.float32)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 2e-2
    # a general module has no MoE reference of its own: --check asks for the exported program
    rc, _, err = cli(capsys, "run", p, "--check")
    assert_one_line_error(rc, err, "compiled from a general module", "--reference")
    block, example = my_block.make()
    torch.export.save(capture(block, example), str(work / "block.pt2"))
    rc, out, err = cli(capsys, "compile", work / "block.pt2", "--target", "cpu", "-o", work / "block2.mxmoe", "-q")
    assert rc == 0, err
    r = mxmoe_cli("run", work / "block2.mxmoe", "--check", "--reference", work / "block.pt2")
    assert r.rc == 0 and "PASS" in r.out, r.out + r.err
    mxmoe_cli("run", work / "block2.mxmoe", "--check", "--reference", work / "my_block.py").error(
        "my_block.py: not a loadable torch.export program (.pt2)")


# ----------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("cmd", ["run", "inspect"])
def test_error_missing_file(capsys, work, cmd):
    rc, _, err = cli(capsys, cmd, work / "absent.mxmoe")
    assert_one_line_error(rc, err, "absent.mxmoe", "no such file")


def test_error_corrupt_artifact(capsys, tiny_art, work):
    raw = bytearray(tiny_art.read_bytes())
    moff = A.HEADER.unpack(bytes(raw[:64]))[3]
    raw[moff + 10] ^= 0x01
    bad = work / "corrupt.mxmoe"
    bad.write_bytes(bytes(raw))
    rc, _, err = cli(capsys, "run", bad)
    assert_one_line_error(rc, err, "corrupt artifact")


def test_error_corrupt_module_section(capsys, tiny_art, work):
    a = A.Artifact(tiny_art)
    raw = bytearray(tiny_art.read_bytes())
    raw[a.section_info("module.vmfb")["offset"] + 200] ^= 0xFF
    bad = work / "corrupt_module.mxmoe"
    bad.write_bytes(bytes(raw))
    rc, _, err = cli(capsys, "run", bad)
    assert_one_line_error(rc, err, "section 'module.vmfb' checksum mismatch")


def test_error_truncated_artifact(capsys, tiny_art, work):
    bad = work / "truncated.mxmoe"
    bad.write_bytes(tiny_art.read_bytes()[:50_000])
    rc, _, err = cli(capsys, "inspect", bad)
    assert_one_line_error(rc, err, "truncated artifact")


def test_error_newer_format(capsys, tiny_art, work):
    raw = bytearray(tiny_art.read_bytes())
    struct.pack_into("<I", raw, 8, 99)
    bad = work / "future.mxmoe"
    bad.write_bytes(bytes(raw))
    rc, _, err = cli(capsys, "run", bad)
    assert_one_line_error(rc, err, "format version 99 is newer", "upgrade mxmoe")


def test_error_unknown_target(capsys, work):
    rc, _, err = cli(capsys, "compile", "--preset", "tiny", "--target", "cuda:sm_42", "-o", work / "x.mxmoe")
    assert_one_line_error(rc, err, "unknown target 'cuda:sm_42'", "rocm:gfx942")


def test_error_target_this_machine_cannot_run(capsys, work):
    p = work / "mi300.mxmoe"
    rc, _, err = cli(capsys, "compile", "--preset", "tiny", "--target", "rocm:gfx942", "-o", p, "-q")
    assert rc == 0, err
    rc, _, err = cli(capsys, "run", p)
    assert_one_line_error(rc, err, "target rocm:gfx942 needs an AMD MI300 GPU (gfx942)")
    rc, out, _ = cli(capsys, "inspect", p)
    assert rc == 0 and "rocm:gfx942" in out


def test_error_checkpoint_missing_tensors(capsys, ckpt, work):
    from mxmoe.core.checkpoint import read_safetensors, write_safetensors

    d, _ = ckpt
    bad = work / "ckpt_missing"
    bad.mkdir()
    (bad / "config.json").write_text((d / "config.json").read_text())
    tensors = dict(read_safetensors(d / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    write_safetensors(bad / "model.safetensors", tensors)
    rc, _, err = cli(capsys, "compile", bad, "--target", "cpu", "-o", work / "m.mxmoe")
    assert_one_line_error(rc, err, "missing tensors", "model.layers.2.mlp.experts.down_proj_scales")


def test_error_not_a_source(capsys, work):
    rc, _, err = cli(capsys, "compile", work / "nothing_here", "--target", "cpu", "-o", work / "m.mxmoe")
    assert_one_line_error(rc, err, "no such file or directory")
    rc, _, err = cli(capsys, "compile", "no_such_module_xyz:make", "--target", "cpu", "-o", work / "m.mxmoe")
    assert_one_line_error(rc, err, "cannot import module 'no_such_module_xyz'")


def test_error_bad_input_file(capsys, tiny_art, work):
    np.save(work / "bad.npy", np.zeros((3, 65), np.float32))
    rc, _, err = cli(capsys, "run", tiny_art, "--input", work / "bad.npy")
    assert_one_line_error(rc, err, "input 'x': dim 1 must be 64")


def test_error_exit_in_a_real_process(tiny_art, tmp_path):
    """The console script itself: non-zero exit, one line, no traceback."""
    exe = Path(sys.executable).with_name("mxmoe")
    r = subprocess.run([str(exe), "run", str(tmp_path / "gone.mxmoe")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"mxmoe: error: {tmp_path / 'gone.mxmoe'}: no such file"]


# ----------------------------------------------------------------------------------------- Triton targets

def test_cuda_artifact_holds_cubins_and_runs_under_the_interpreter(capsys, work):
    """A cuda:sm_90 artifact compiled here (cubins, kernel plan, safetensors weights) is refused on this
    GPU-less machine, and its kernel plan runs under Triton's interpreter and matches the reference."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    p = work / "h100.mxmoe"
    rc, out, err = cli(capsys, "compile", "--preset", "tiny", "--target", "cuda:sm_90", "-o", p, "--seed", 2)
    assert rc == 0, err
    man = A.Artifact(p).manifest
    kinds = {s["kind"] for s in man["sections"]}
    assert kinds == {A.KIND_CUBIN, A.KIND_SAFETENSORS}
    assert man["module"]["kind"] == "triton" and man["module"]["kernel_plan"]
    rc, _, err = cli(capsys, "run", p)
    assert_one_line_error(rc, err, "target cuda:sm_90 needs an NVIDIA Hopper GPU (sm_90)")
    rc, out, err = cli(capsys, "run", p, "--device", "interpret", "--tokens", 5, "--check", "--repeat", 1)
    assert rc == 0 and "PASS" in out, out + err


def test_compile_every_entry_and_check_each(mxmoe_cli, tmp_path):
    """`--entries all` puts the layer, monolithic and modular entries in one artifact over one weight set; inspect
    lists them; `run --check` runs and checks each against the reference (its routing inputs valid for the layer);
    `--entry` picks one; an unknown one is one line."""
    art = tmp_path / "e.mxmoe"
    r = mxmoe_cli("compile", "--preset", "tiny", "--target", "cpu", "--entries", "all", "-o", art, "-q")
    assert r.rc == 0, r.err
    r = mxmoe_cli("inspect", art)
    assert all(f"entry       {name}(" in r.out for name in ("layer", "monolithic", "modular")), r.out
    r = mxmoe_cli("run", art, "--check", "--tokens", 6)
    assert r.rc == 0, r.err
    assert [ln.split(":")[0] for ln in r.out.splitlines() if ln.startswith("check")] == [
        "check (layer)", "check (monolithic)", "check (modular)"] and r.out.count("PASS") == 3, r.out
    r = mxmoe_cli("run", art, "--check", "--tokens", 2, "--entry", "modular", "--numpy-reference")
    assert r.rc == 0 and "check (modular)" in r.out and "numpy reference" in r.out, r.out + r.err
    mxmoe_cli("run", art, "--entry", "sideways").error("no entry point 'sideways'", "layer, monolithic, modular")
    mxmoe_cli("compile", "--preset", "tiny", "--target", "cpu", "--entries", "layer,sideways", "-o", art,
              "-q").error("unknown entry 'sideways'")


@pytest.mark.parametrize("flags,expected", [([], {}), (["--deterministic"], {"deterministic": True}),
                                            (["--no-deterministic"], {"deterministic": False}),
                                            (["--batch-invariant"], {"batch_invariant": True})])
def test_numerics_flags_reach_compile_only_when_given(flags, expected):
    """No flag leaves the target's default (deterministic on cuda and cpu); --no-deterministic asks for the
    atomics path explicitly."""
    from mxmoe.cli import _numerics_flags, build_parser

    args = build_parser().parse_args(["compile", "--target", "cuda:sm_90", "-o", "x.mxmoe", *flags])
    assert _numerics_flags(args) == expected
