"""Check every MoE family of the installed transformers with mxmoe's experts implementation
(``python -m mxmoe.transformers --families``; the table is in docs/transformers.md).

For each model folder of transformers whose modeling file decorates an experts class with
``use_experts_implementation``, this builds a tiny random model from the family's own config class (a text model
with a causal-LM head where the family has one), quantizes its experts to MXFP4 (:func:`quantize_experts`), writes
the dequantized floats back (:func:`dequantize_experts`) and compares, in fp32:

* the logits (or last hidden states) of the eager model with those dequantized weights against the same model
  running its experts through mxmoe (``set_experts_implementation("mxmoe")``): relative error <= 1e-4;
* greedy generation of 8 tokens: identical token ids.

A family is ``works``, ``unsupported`` (mxmoe refused its experts: the reason is mxmoe's one-line error) or
``failed`` (a mismatch, or the tiny model could not be built or run: the reason says which).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
import time
import warnings
from dataclasses import dataclass, field

import torch

__all__ = ["FamilyResult", "moe_families", "check_family", "check_families", "format_table"]

#: relative error allowed between the eager model (dequantized weights) and mxmoe's experts, in fp32
TOLERANCE = 1e-4
TOKENS = 12
#: a tiny model larger than this is not built (a config field the shrinking missed)
MAX_PARAMS = 30_000_000
NEW_TOKENS = 8


@dataclass
class FamilyResult:
    family: str
    status: str                         # "works", "unsupported", "failed"
    reason: str = ""
    model: str = ""                     # the model class built
    experts: list[str] = field(default_factory=list)    # experts classes and their mxmoe mapping
    rel_error: float | None = None
    generation_equal: bool | None = None
    seconds: float = 0.0


def moe_families() -> list[str]:
    """Model folders of the installed transformers whose modeling code decorates an experts class with
    ``use_experts_implementation`` (the families that route their experts through the ExpertsInterface)."""
    import transformers

    root = pathlib.Path(transformers.__file__).parent / "models"
    out = []
    for p in sorted(root.glob("*/modeling_*.py")):
        if p.stem == f"modeling_{p.parent.name}" and "@use_experts_implementation" in p.read_text():
            out.append(p.parent.name)
    return out


# ============================================================================================ tiny configs
#: config fields set on every tiny config that has them
_SIZES = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "shared_intermediate_size": 64, "shared_experts_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64, "dense_intermediate_size": 64, "moe_hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8,
    "moe_num_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 24, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 16, "index_kpool": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_head_dim": 16,
    "linear_num_heads": 4, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_head_dim": 16,
    "mamba_num_heads": 4, "mamba_chunk_size": 16, "chunk_size": 16, "ssm_state_size": 8, "mamba_dt_rank": 8,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16, "rotary_dim": 8,
    "router_hidden_size": 64, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256,
    "o_lora_rank": 32, "gated_norm_rank": 16, "hc_lowrank": 8, "ple_embed_dim": 16, "moe_layer_end_index": 1,
    "moe_layer_start_index": 0, "moe_layer_interval": 1, "decoder_sparse_step": 1, "moe_layer_freq": 1,
    "expert_interval": 1, "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 2,
    "attn_layer_offset": 0, "max_window_layers": 2, "index_block_size": 16, "index_topk_blocks": 2,
    "block_size": 16, "model_max_length": 256, "n_shared_experts": 1, "top_k_experts": 2,
}
#: what a family's config checks beyond the sizes above
_FAMILY = {"zaya": {"num_experts_per_tok": 1}, "lfm2_moe": {"layer_types": ["conv", "full_attention"],
                                                             "num_dense_layers": 1},
           "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},
           "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
           "gemma4_text": {"global_head_dim": 16, "enable_moe_block": True},
           "diffusion_gemma_text": {"global_head_dim": 16, "enable_moe_block": True},
           "dots3_note_text": {"layer_types": ["indexed_attention", "indexed_attention"]},
           "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
                              "indexer_compress_ratio": 4},
           "glm5_next_text": {"qk_rope_head_dim": 0, "head_dim": 16},
           # multimodal rotary sections: their halves of the tiny head (16 / 2)
           "ernie4_5_vl_moe_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                                                        "mrope_section": [3, 3, 2]}},
           "hy_v4_vl_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 1, 1]}},
           "glm4v_moe_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [2, 3, 3], "partial_rotary_factor": 1.0}}}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id",
              "image_token_id", "video_token_id", "audio_token_id", "image_token_index")


def _fields(cfg_cls) -> set[str]:
    names = set()
    if dataclasses.is_dataclass(cfg_cls):
        names |= {f.name for f in dataclasses.fields(cfg_cls)}
    try:
        names |= set(inspect.signature(cfg_cls.__init__).parameters)
    except (TypeError, ValueError):
        pass
    return names


def _shrink_list(value, n: int):
    """A per-layer list cut to ``n`` entries keeping one layer of each kind it names (MoE and dense, full and
    linear attention...), kinds in order of first appearance."""
    if not isinstance(value, (list, tuple)) or len(value) <= n:
        return value
    kinds = list(dict.fromkeys(value)) if all(isinstance(v, (str, bool, int)) for v in value) else []
    if 1 < len(kinds) <= n:
        return kinds + [value[0]] * (n - len(kinds))
    return list(value[:n])


def _layer_count(base) -> int:
    """Layers of the tiny model: 2, or as many as the kinds a per-layer list names (at most 4)."""
    n = 2
    layers = _get(base, "num_hidden_layers")
    for v in base.to_dict().values():
        if isinstance(v, (list, tuple)) and len(v) == layers and all(isinstance(x, (str, bool, int)) for x in v):
            n = max(n, min(4, len(set(v))))
    return n


def _get(cfg, name: str, default=None):
    """A config attribute, or ``default`` where reading it raises (a per-layer attribute of a heterogeneous model)."""
    try:
        return getattr(cfg, name, default)
    except Exception:  # noqa: BLE001
        return default


def tiny_config(cfg_cls, **extra):
    """A tiny instance of config class ``cfg_cls``: sizes of :data:`_SIZES` where it has such fields, per-layer lists
    cut to the layer count (keeping an MoE layer), token ids inside the tiny vocabulary."""
    base = cfg_cls()
    names = _fields(cfg_cls) | set(base.to_dict())
    kw = {k: v for k, v in _SIZES.items() if k in names}
    for k, v in list(kw.items()):  # a size given per something (a list): the tiny size for each
        d = _get(base, k, None)
        if isinstance(d, (list, tuple)) and k != "num_hidden_layers":
            kw[k] = [v] * len(d)
    if "mamba_expand" in names and "mamba_n_heads" in kw and "mamba_d_head" in kw:
        kw["mamba_d_head"] = int(_get(base, "mamba_expand", 2) * kw.get("hidden_size", 64)) // kw["mamba_n_heads"]
    n_layers = _layer_count(base)
    if "num_hidden_layers" in kw:
        kw["num_hidden_layers"] = n_layers
    for k, v in base.to_dict().items():
        if isinstance(v, (list, tuple)) and k not in kw and len(v) == _get(base, "num_hidden_layers", -1):
            kw[k] = _shrink_list(v, n_layers)
        if k in _TOKEN_IDS and v is not None:
            kw[k] = [i % 200 for i in v] if isinstance(v, (list, tuple)) else (v % 200 if isinstance(v, int) else v)
    if "kv_lora_rank" in kw and "num_key_value_heads" in kw:  # multi-head latent attention: a key per head
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    if "qk_rope_head_dim" in kw:  # multi-head latent attention: rotary embeddings are head_dim wide
        kw["head_dim"] = kw["qk_rope_head_dim"] if "head_dim" in names else None
        kw.pop("head_dim") if kw.get("head_dim") is None else None
        if "qk_head_dim" in names:
            kw["qk_head_dim"] = kw["qk_rope_head_dim"] + kw.get("qk_nope_head_dim", 0)
    for k in ("mlp_only_layers",):
        if k in names:
            kw[k] = []
    from transformers import PretrainedConfig

    for k, v in vars(base).items():  # sub-configs (a multimodal model's text / vision / audio parts): tiny too
        if isinstance(v, PretrainedConfig) and k in names and k not in kw:
            try:
                kw[k] = tiny_config(type(v))
            except Exception:  # noqa: BLE001 - keep the default sub-config; the size check below guards
                pass
    if "moe_layers" in names and isinstance(_get(base, "moe_layers", None), (list, tuple)):
        kw["moe_layers"] = [1]
    kw.update(_FAMILY.get(getattr(cfg_cls, "model_type", ""), {}))
    kw.update(extra)
    try:
        return cfg_cls(**kw)
    except TypeError:  # a field that is not an argument: set what the constructor takes, the rest after
        init = set(inspect.signature(cfg_cls.__init__).parameters)
        cfg = cfg_cls(**{k: v for k, v in kw.items() if k in init})
        for k, v in kw.items():
            if k not in init:
                setattr(cfg, k, v)
        return cfg


# ============================================================================================ model classes
def _model_candidates(family: str) -> list[tuple[str, type]]:
    """(model type, model class) to try for a family: text causal LMs first, then causal LMs, then base models."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    try:
        configuration = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    except ImportError:
        configuration = None
    types = [t for t, c in CONFIG_MAPPING_NAMES.items()
             if configuration is not None and getattr(configuration, c, None) is not None
             and getattr(configuration, c).__module__ == configuration.__name__]
    found: list[tuple[int, str, type]] = []
    for t in types:
        cfg_cls = CONFIG_MAPPING[t]
        text = t.endswith("_text") or t == family
        for rank, mapping in ((0, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), (2, MODEL_MAPPING_NAMES)):
            name = mapping.get(t)
            cls = getattr(modeling, name, None) if isinstance(name, str) else None
            if cls is not None and getattr(cls, "config_class", cfg_cls) in (cfg_cls, None):
                found.append((rank + (0 if text else 1) + (0 if t.endswith("_text") else 0.5), t, cls))
        if not any(f[1] == t for f in found):  # a config without an auto mapping: a model class of the module for it
            for name, cls in vars(modeling).items():
                if (inspect.isclass(cls) and getattr(cls, "config_class", None) is cfg_cls
                        and cls.__module__ == modeling.__name__ and not name.endswith("PreTrainedModel")
                        and (name.endswith("ForCausalLM") or name.endswith("Model"))):
                    found.append((0.2 if name.endswith("ForCausalLM") else 2.2, t, cls))
    found.sort(key=lambda f: f[0])
    return [(t, cls) for _, t, cls in found]


def tiny_model(family: str, seed: int = 0, randomize: bool = True):
    """A tiny random model of ``family`` (the first candidate class that builds with experts; ValueError saying why
    none does), in fp32, eval mode, its experts drawn by :func:`_randomize`."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    transformers.logging.set_verbosity_error()
    errors = []
    for mtype, cls in _model_candidates(family):
        try:
            torch.manual_seed(seed)
            cfg = tiny_config(CONFIG_MAPPING[mtype])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with torch.device("meta"):  # count first: a sub-config left at its real size would fill the RAM
                    n = sum(p.numel() for p in cls(cfg).parameters())
                if n > MAX_PARAMS:
                    raise ValueError(f"the tiny config still makes {n / 1e6:.0f}M parameters")
                model = cls(cfg).eval().float()
        except Exception as e:  # noqa: BLE001 - try the next candidate, report if none builds
            errors.append(f"{cls.__name__}: {_first_line(e)}")
            continue
        if not _experts_modules(model):
            errors.append(f"{cls.__name__}: no experts module in the tiny model")
            continue
        if randomize:
            _randomize(model, seed)
        return model
    raise ValueError("tiny model not built: " + ("; ".join(errors[:2]) or "no causal LM or base model for its configs"))


# ============================================================================================ the check
def _experts_modules(model) -> list:
    from mxmoe.torch_frontend.families import is_experts

    return [(n, m) for n, m in model.named_modules() if is_experts(m)]


def check_family(family: str, target=None, seed: int = 0) -> FamilyResult:
    """Build a tiny ``family`` model and compare mxmoe's experts with the eager ones (see the module docstring)."""
    import mxmoe.transformers as mt
    from mxmoe.transformers import experts as ex

    t0 = time.perf_counter()
    res = FamilyResult(family, "failed")
    try:
        model = tiny_model(family, seed)
    except Exception as e:  # noqa: BLE001 - reported
        res.reason = str(e) if isinstance(e, ValueError) else f"cannot import its modeling code: {_first_line(e)}"
        return _done(res, t0)
    res.model = type(model).__name__
    try:
        report = mt.quantize_experts(model, target=target, progress=False)
    except Exception as e:  # noqa: BLE001
        res.reason = f"quantize_experts: {_first_line(e)}"
        return _done(res, t0)
    res.experts = sorted({f"{m.cls} ({m.activation}, {m.layout}{', bias' if m.bias else ''})" for m in report.modules})
    if report.skipped and not report.modules:
        res.status = "unsupported"
        res.reason = sorted({s.reason for s in report.skipped})[0]
        return _done(res, t0)
    mt.dequantize_experts(model)
    calls = [0]
    real = ex.mxmoe_experts_forward

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    from transformers.integrations.moe import ExpertsInterface

    try:
        ids = torch.randint(3, 200, (1, TOKENS), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            model.set_experts_implementation("eager")
            ref = _outputs(model, ids)
            ExpertsInterface.register("mxmoe", counting)
            model.set_experts_implementation("mxmoe")
            out = _outputs(model, ids)
            if not calls[0]:
                res.reason = "the tiny model ran no experts through the interface"
                return _done(res, t0)
            res.rel_error = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            if _is_causal_lm(model):
                gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
                model.set_experts_implementation("eager")
                gen_ref = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
                res.generation_equal = bool(torch.equal(gen, gen_ref))
    except ex.Unsupported as e:
        res.status, res.reason = "unsupported", e.reason
        return _done(res, t0)
    except Exception as e:  # noqa: BLE001
        res.reason = f"running it: {_first_line(e)}"
        return _done(res, t0)
    finally:
        ExpertsInterface.register("mxmoe", real)
    if res.rel_error > TOLERANCE:
        res.reason = f"logits differ from eager's: relative error {res.rel_error:.2e}"
    elif res.generation_equal is False:
        res.reason = "greedy generation differs from eager's"
    else:
        res.status = "works"
        if report.skipped:
            res.reason = "partly: " + "; ".join(sorted({f"{s.cls}: {s.reason}" for s in report.skipped}))
    return _done(res, t0)


def _randomize(model, seed: int) -> None:
    """Experts weights drawn wide enough that quantization and the GLU matter (inits may leave them zero)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, m in _experts_modules(model):
            for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                p = getattr(m, n, None)
                if isinstance(p, torch.Tensor) and p.is_floating_point():
                    fan_in = p.shape[-1] if p.dim() == 3 and not m.is_transposed else p.shape[-2] if p.dim() == 3 else 10
                    p.copy_(torch.randn(p.shape, generator=g) / max(fan_in, 1) ** 0.5 * (0.1 if p.dim() == 2 else 1))


def _is_causal_lm(model) -> bool:
    return type(model).__name__.endswith("ForCausalLM") and hasattr(model, "generate")


def _outputs(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids)
    t = getattr(out, "logits", None)
    if t is None:
        t = getattr(out, "last_hidden_state", None)
    if t is None:
        t = out[0]
    return t.float()


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"[:240]


def _done(res: FamilyResult, t0: float) -> FamilyResult:
    res.seconds = time.perf_counter() - t0
    return res


def check_families(families: list[str] | None = None, target=None, progress=None) -> list[FamilyResult]:
    """:func:`check_family` for ``families`` (default: every MoE family of the installed transformers)."""
    import transformers

    transformers.logging.set_verbosity_error()
    out = []
    for fam in families if families is not None else moe_families():
        r = check_family(fam, target=target)
        out.append(r)
        if progress is not None:
            progress(r)
    return out


def format_table(results: list[FamilyResult]) -> str:
    """A markdown table of the results (docs/transformers.md)."""
    import transformers

    lines = [f"transformers {transformers.__version__}, torch {torch.__version__}: "
             f"{sum(r.status == 'works' for r in results)} of {len(results)} families work", "",
             "| family | status | model built | experts (mxmoe activation, gate/up layout) | rel. error | greedy | note |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        err = "" if r.rel_error is None else f"{r.rel_error:.1e}"
        gen = "" if r.generation_equal is None else ("same" if r.generation_equal else "differs")
        note = r.reason.replace("|", "/")
        lines.append(f"| {r.family} | {r.status} | {r.model} | {'; '.join(r.experts)} | {err} | {gen} | {note} |")
    return "\n".join(lines)


