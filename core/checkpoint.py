"""Read and write MoE layers in safetensors checkpoints, without torch (the format: ``mxmoe.core.safetensors``).

Reads are memory-mapped, so opening a gpt-oss-120b shard costs nothing until a tensor is touched, and MXFP4
blocks reach ``MoEWeights`` without a copy (read-only views).

Two layer layouts are supported:

* Hugging Face gpt-oss (``model.layers.{i}.mlp.`` + ``router.weight``, ``experts.gate_up_proj_blocks``
  ``[E, 2I, H/32, 16]`` ...; gate/up rows interleaved): ``read_hf_gpt_oss`` / ``write_hf_gpt_oss``.
  The blocks use our nibble order, so they reshape to ``w13 [E, 2I, H/2]`` as is.
* vLLM fused-MoE names under a prefix (``w13_weight``, ``w13_weight_scale`` ...):
  ``read_vllm`` / ``write_vllm``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from mxmoe.core.bridge import numpy_dtype
from mxmoe.core.config import MXFP4_BLOCK, MoEConfig
from mxmoe.core.safetensors import SafetensorsFile, read_safetensors, write_safetensors
from mxmoe.core.weights import VLLM_NAMES, MoEWeights, check_tensor, expected_tensors

__all__ = [
    "SafetensorsFile",
    "read_safetensors",
    "write_safetensors",
    "read_hf_config",
    "hf_moe_layers",
    "read_hf_gpt_oss",
    "write_hf_gpt_oss",
    "read_vllm",
    "write_vllm",
]

# ============================================================================ checkpoints (file or dir)

_INDEX = "model.safetensors.index.json"


class _Tensors:
    """Tensor names -> files for one safetensors file or a checkpoint directory (sharded or not)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._files: dict[Path, SafetensorsFile] = {}
        index = self.path / _INDEX
        if self.path.is_file():
            self._where = dict.fromkeys(self._open(self.path).keys(), self.path)
            self.label = str(self.path)
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self._where = {name: self.path / shard for name, shard in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{index}: corrupt index, expected JSON with a 'weight_map' ({exc!r})") from None
            self.label = str(index)
        elif self.path.is_dir():
            shards = sorted(self.path.glob("*.safetensors"))
            if not shards:
                raise ValueError(f"{self.path}: no *.safetensors files")
            self._where = {}
            for shard in shards:
                self._where.update(dict.fromkeys(self._open(shard).keys(), shard))
            self.label = ", ".join(str(s) for s in shards)
        else:
            raise ValueError(f"{self.path}: no such safetensors file or checkpoint directory")

    def _open(self, path: Path) -> SafetensorsFile:
        if path not in self._files:
            if not path.is_file():
                raise ValueError(f"{path}: shard listed in {self.path / _INDEX} does not exist")
            self._files[path] = SafetensorsFile(path)
        return self._files[path]

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, names: list[str]) -> dict[str, np.ndarray]:
        missing = [n for n in names if n not in self._where]
        if missing:
            raise ValueError(f"missing tensors in {self.label}: {', '.join(missing)}")
        out = {}
        for n in names:
            f = self._open(self._where[n])
            if n not in f:
                raise ValueError(f"{f.path}: missing tensor {n} (the index says it is there)")
            out[n] = f.get(n)
        return out


def _float_tensor(name: str, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Router/bias tensors may be bf16/f16/f32/f64 on disk; we hold float32."""
    if a.shape != tuple(shape) or a.dtype.name not in ("bfloat16", "float16", "float32", "float64"):
        raise ValueError(f"{name}: expected shape {tuple(shape)} float (bf16/f16/f32), got {a.shape} {a.dtype}")
    return a.astype(np.float32)


def _to_weights(config: MoEConfig, tensors: dict[str, np.ndarray], names: dict[str, str]) -> MoEWeights:
    """Build MoEWeights from checkpoint tensors (``names``: field -> checkpoint name), checking with full names."""
    fields = {}
    for field, spec in expected_tensors(config).items():
        if spec is None:
            fields[field] = None
            continue
        shape, dtype = spec
        a = tensors[names[field]]
        if dtype == np.uint8:
            check_tensor(names[field], a, shape, dtype)
            fields[field] = a
        else:
            fields[field] = _float_tensor(names[field], a, shape)
    return MoEWeights(config, **fields)


def _float_out(a: np.ndarray | None, float_dtype: str) -> np.ndarray | None:
    if float_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"float_dtype: expected 'float32' or 'bfloat16', got {float_dtype!r}")
    return None if a is None else a.astype(numpy_dtype("bfloat16") if float_dtype == "bfloat16" else np.float32)


def _merge(name_to_array: dict[str, np.ndarray], extra_tensors: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    clash = sorted(set(name_to_array) & set(extra_tensors or {}))
    if clash:
        raise ValueError(f"extra_tensors: names clash with layer tensors: {', '.join(clash)}")
    return {**name_to_array, **(extra_tensors or {})}


# ============================================================================ Hugging Face gpt-oss

_HF_CONFIG_KEYS = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "top_k",
    "hidden_size": "hidden",
    "intermediate_size": "intermediate",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj_blocks$")


def _hf_names(layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}.mlp."
    return {
        "router_weight": p + "router.weight",
        "router_bias": p + "router.bias",
        "w13": p + "experts.gate_up_proj_blocks",
        "w13_scale": p + "experts.gate_up_proj_scales",
        "w13_bias": p + "experts.gate_up_proj_bias",
        "w2": p + "experts.down_proj_blocks",
        "w2_scale": p + "experts.down_proj_scales",
        "w2_bias": p + "experts.down_proj_bias",
    }


def read_hf_config(ckpt_dir: str | os.PathLike) -> MoEConfig:
    """The MoE layer config of a gpt-oss checkpoint directory's ``config.json``."""
    path = Path(ckpt_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: not found") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if cfg.get("model_type", "gpt_oss") != "gpt_oss":
        raise ValueError(f"{path}: expected model_type 'gpt_oss', got {cfg['model_type']!r}")
    if "num_experts_per_tok" not in cfg and "experts_per_token" in cfg:
        cfg = {**cfg, "num_experts_per_tok": cfg["experts_per_token"]}
    missing = [k for k in _HF_CONFIG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"{path}: missing keys {', '.join(missing)}")
    fields = {ours: cfg[theirs] for theirs, ours in _HF_CONFIG_KEYS.items()}
    try:
        return MoEConfig(**fields, swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def hf_moe_layers(ckpt_dir: str | os.PathLike) -> list[int]:
    """Indices of the layers whose MoE experts are in the checkpoint, ascending."""
    return _moe_layers(_Tensors(ckpt_dir))


def _moe_layers(files: _Tensors) -> list[int]:
    return sorted(int(m.group(1)) for n in files.names() if (m := _HF_LAYER.match(n)))


def read_hf_gpt_oss(ckpt_dir: str | os.PathLike, layer: int) -> MoEWeights:
    """Layer ``layer``'s MoE from a Hugging Face gpt-oss checkpoint (MXFP4 blocks are not copied)."""
    config = read_hf_config(ckpt_dir)
    names = _hf_names(layer)
    files = _Tensors(ckpt_dir)
    if not set(names.values()) & set(files.names()):
        have = _moe_layers(files)
        listed = (f"{have[0]}..{have[-1]}" if len(have) > 2 and have == list(range(have[0], have[-1] + 1))
                  else ", ".join(map(str, have)) or "none")
        raise ValueError(f"{ckpt_dir}: no MoE layer {layer} (MoE layers: {listed})")
    tensors = files.get(list(names.values()))
    e, i, h = config.num_experts, config.intermediate, config.hidden
    for field, rows, k in (("w13", 2 * i, h), ("w2", h, i)):
        name = names[field]
        check_tensor(name, tensors[name], (e, rows, k // MXFP4_BLOCK, MXFP4_BLOCK // 2), np.uint8)
        tensors[name] = tensors[name].reshape(e, rows, k // 2)
    return _to_weights(config, tensors, names)


def write_hf_gpt_oss(
    ckpt_dir: str | os.PathLike,
    layers: dict[int, MoEWeights],
    extra_tensors: dict[str, np.ndarray] | None = None,
    *,
    float_dtype: str = "float32",
    extra_config: dict | None = None,
) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the gpt-oss layout (for tests and demos).

    All layers must share one config that gpt-oss can express (interleaved gate/up, biases,
    topk_softmax routing, swiglu_oai with alpha 1.702). Router and biases are stored as ``float_dtype``
    ("float32", lossless, or "bfloat16" like the released checkpoints). ``extra_config`` entries are
    added to config.json (e.g. vocab_size for a loadable model).
    """
    if not layers:
        raise ValueError("layers: expected at least one layer, got none")
    configs = {w.config for w in layers.values()}
    if len(configs) != 1:
        raise ValueError(f"layers: expected one shared config, got {len(configs)} different ones")
    (config,) = configs
    gpt_oss = MoEConfig(config.num_experts, config.top_k, config.hidden, config.intermediate,
                        swiglu_limit=config.swiglu_limit)
    if config != gpt_oss:
        diff = {k: v for k, v in config.to_dict().items() if gpt_oss.to_dict()[k] != v}
        raise ValueError(f"layers: config not expressible in the gpt-oss layout, differs in {diff}")
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if (ckpt_dir / _INDEX).exists():
        raise ValueError(f"{ckpt_dir / _INDEX}: exists and would shadow the model.safetensors being written")

    tensors = {}
    for layer, w in sorted(layers.items()):
        names = _hf_names(layer)
        e, i, h = config.num_experts, config.intermediate, config.hidden
        blocks = {"w13": w.w13.reshape(e, 2 * i, h // MXFP4_BLOCK, MXFP4_BLOCK // 2),
                  "w2": w.w2.reshape(e, h, i // MXFP4_BLOCK, MXFP4_BLOCK // 2)}
        for field in names:
            a = blocks.get(field, getattr(w, field))
            tensors[names[field]] = a if a.dtype == np.uint8 else _float_out(a, float_dtype)

    hf_config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "num_hidden_layers": max(layers) + 1,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.top_k,
        "experts_per_token": config.top_k,
        "hidden_size": config.hidden,
        "intermediate_size": config.intermediate,
        "swiglu_limit": config.swiglu_limit,
        "quantization_config": {"quant_method": "mxfp4"},
        **(extra_config or {}),
    }
    write_safetensors(ckpt_dir / "model.safetensors", _merge(tensors, extra_tensors), {"format": "pt"})
    (ckpt_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


# ============================================================================ vLLM fused-MoE names


def _vllm_names(prefix: str, router_prefix: str) -> dict[str, str]:
    names = {f: prefix + n for f, n in VLLM_NAMES.items()}
    names["router_weight"] = router_prefix + "weight"
    names["router_bias"] = router_prefix + "bias"
    return names


def read_vllm(path: str | os.PathLike, prefix: str, router_prefix: str, config: MoEConfig) -> MoEWeights:
    """A layer stored under vLLM names: ``{prefix}w13_weight`` ..., router at ``{router_prefix}weight``/``bias``.

    ``path`` is a safetensors file or a checkpoint directory; prefixes are concatenated as given
    (include the trailing dot). Floats may be bf16/f16/f32 on disk.
    """
    names = _vllm_names(prefix, router_prefix)
    wanted = [names[f] for f, spec in expected_tensors(config).items() if spec is not None]
    return _to_weights(config, _Tensors(path).get(wanted), names)


def write_vllm(
    path: str | os.PathLike,
    weights: MoEWeights,
    prefix: str,
    router_prefix: str,
    extra_tensors: dict[str, np.ndarray] | None = None,
    *,
    float_dtype: str = "float32",
) -> None:
    """Write one layer under vLLM names to the safetensors file ``path`` (inverse of ``read_vllm``)."""
    names = _vllm_names(prefix, router_prefix)
    tensors = {}
    for field, name in names.items():
        a = getattr(weights, field)
        if a is not None:
            tensors[name] = a if a.dtype == np.uint8 else _float_out(a, float_dtype)
    write_safetensors(path, _merge(tensors, extra_tensors), {"format": "pt"})
