"""``mxmoe compile <hf-dir>`` on checkpoints of the MoE families (docs/transformers.md): a tiny Qwen2-MoE (shared
expert with its gate) and DeepSeek-V3 (fp32 router, correction bias, groups) saved by transformers, compiled for the
cpu target with every MoE layer's weights (quantized while packing), checked by ``run --check``, with the layer
picked by ``--layer``; ``--weights external`` is refused with the reason."""

from __future__ import annotations

import warnings

import pytest
import torch

from mxmoe.cli import main
from mxmoe.runtime import load

transformers = pytest.importorskip("transformers")


def _save(family: str, path) -> None:
    from mxmoe.transformers.families import tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_model(family, randomize=False).save_pretrained(path)


@pytest.mark.parametrize("family, layers", [("qwen2_moe", ["layer.0", "layer.1"]), ("deepseek_v3", ["layer.1"])])
def test_compile_a_family_checkpoint_and_check_it(family, layers, tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "m.mxmoe"
    _save(family, ckpt)
    assert main(["compile", str(ckpt), "--target", "cpu", "-o", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert f"{len(layers)} set(s): {', '.join(layers)}" in capsys.readouterr().out
    assert load(out).entry_names == ["layer"]
    assert main(["run", str(out), "--tokens", "5", "--check"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_layer_choice_and_external_weights(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _save("qwen3_moe", ckpt)
    assert main(["compile", str(ckpt), "--target", "cpu", "--layer", "1", "-o", str(tmp_path / "a.mxmoe"),
                 "--quiet"]) == 0
    assert main(["compile", str(ckpt), "--target", "cpu", "--layer", "7", "-o", str(tmp_path / "b.mxmoe")]) != 0
    assert "no MoE layer 7 (layers: 0, 1)" in capsys.readouterr().err
    assert main(["compile", str(ckpt), "--target", "cpu", "--weights", "external", "-o",
                 str(tmp_path / "c.mxmoe")]) != 0
    assert "--weights external reads MXFP4 gpt-oss checkpoints only" in capsys.readouterr().err
