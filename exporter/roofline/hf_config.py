"""A Hugging Face ``config.json`` turned into a ``ModelSpec``: dense, GQA, MoE, MLA.

Parameters are counted from the architecture, the way model cards count them
(embeddings and the LM head included; a tied head counted once):

* attention per layer: q, k, v, o projections (``num_key_value_heads`` < heads is
  GQA/MQA); MLA (DeepSeek-V2/V3: ``kv_lora_rank``) uses the low-rank q/kv
  projections and caches one latent of ``kv_lora_rank + qk_rope_head_dim`` per token;
* MLP per layer: gated (gate, up, down = 3 x hidden x intermediate);
* MoE: Mixtral/gpt-oss (``num_local_experts``), Qwen-MoE (``num_experts``,
  ``moe_intermediate_size``, ``shared_expert_intermediate_size``), DeepSeek
  (``n_routed_experts``, ``n_shared_experts``, ``first_k_dense_replace``); active
  parameters count the shared experts and ``num_experts_per_tok`` routed ones.

Weight dtype comes from ``quantization_config`` (fp8, AWQ/GPTQ bits, MXFP4,
bitsandbytes, compressed-tensors, ModelOpt) or else ``torch_dtype``/``dtype``.
Anything missing or contradictory raises ``ValueError`` naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phasewatch.roofline.catalog import ModelSpec

_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                 "float": "fp32"}


def _int(cfg: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"config.json: {k} must be a non-negative integer, got {v!r}")
            return v
    if default is None:
        raise ValueError(f"config.json: missing {' or '.join(keys)}")
    return default


def weight_dtype_of(cfg: Mapping[str, Any]) -> str:
    """Stored weight dtype: quantization first, then the checkpoint's torch dtype."""
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "mxfp4":
        return "mxfp4"
    if method == "fp8" or str(q.get("quant_algo", "")).upper() == "FP8":
        return "fp8"
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        return {4: "int4", 8: "int8"}.get(q.get("bits", 4), "int4")
    if method == "bitsandbytes":
        return "int4" if q.get("load_in_4bit") else "int8"
    if method == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            weights = (group or {}).get("weights") or {}
            bits, kind = weights.get("num_bits"), str(weights.get("type", "int"))
            if bits == 8:
                return "fp8" if kind == "float" else "int8"
            if bits == 4:
                return "int4"
    if method == "modelopt" and "FP4" in str(q.get("quant_algo", "")).upper():
        return "int4"  # NVFP4: 4-bit values + fp8 block scales, ~4.5 bits like int4 + scales
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower()
    dtype = dtype.removeprefix("torch.")
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"config.json: unsupported torch_dtype {dtype!r}")
    return _TORCH_DTYPES[dtype]


def _attention(cfg: Mapping[str, Any], hidden: int, heads: int) -> tuple[int, dict]:
    """Attention parameters per layer and the ModelSpec fields describing it."""
    if cfg.get("kv_lora_rank"):  # MLA
        q_lora = cfg.get("q_lora_rank")
        nope, rope = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim")
        v_dim, kv_lora = _int(cfg, "v_head_dim"), _int(cfg, "kv_lora_rank")
        qk = nope + rope
        q = hidden * q_lora + q_lora * heads * qk if q_lora else hidden * heads * qk
        kv = hidden * (kv_lora + rope) + kv_lora * heads * (nope + v_dim)
        o = heads * v_dim * hidden
        return q + kv + o, dict(kv_heads=1, head_dim=qk, v_head_dim=v_dim,
                                kv_dim_per_layer=kv_lora + rope)
    head_dim = _int(cfg, "head_dim", default=hidden // heads)
    kv_heads = _int(cfg, "num_key_value_heads", default=heads)
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"config.json: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv_heads}")
    params = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    return params, dict(kv_heads=kv_heads, head_dim=head_dim)


def _mlp(cfg: Mapping[str, Any], hidden: int, layers: int) -> tuple[int, int, int, int]:
    """(total MLP params, active MLP params, routed experts, experts per token)."""
    gated = 3 * hidden  # gate, up and down projections: 3 x hidden x intermediate
    experts = _int(cfg, "num_local_experts", "n_routed_experts", "num_experts", default=0)
    if not experts:
        dense = gated * _int(cfg, "intermediate_size") * layers
        return dense, dense, 0, 0
    k = _int(cfg, "num_experts_per_tok", "experts_per_token")
    if not 0 < k <= experts:
        raise ValueError(f"config.json: num_experts_per_tok {k} must be in 1..{experts}")
    expert = gated * _int(cfg, "moe_intermediate_size", "intermediate_size")
    shared = gated * _int(cfg, "shared_expert_intermediate_size", default=0) + expert * _int(
        cfg, "n_shared_experts", default=0)
    dense_layers = _int(cfg, "first_k_dense_replace", default=0)
    dense_mlp = gated * _int(cfg, "intermediate_size") if dense_layers else 0
    moe_layers = layers - dense_layers
    router = hidden * experts
    total = moe_layers * (experts * expert + shared + router) + dense_layers * dense_mlp
    active = moe_layers * (k * expert + shared + router) + dense_layers * dense_mlp
    return total, active, experts, k


def model_from_config(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    """A ``ModelSpec`` from a parsed config.json (see the module docstring); ValueError
    naming what is wrong for anything that is not a usable config."""
    if not isinstance(cfg, Mapping):
        raise ValueError("config.json must hold a JSON object")
    try:
        spec = _model_from_config(cfg, name)
    except (TypeError, AttributeError) as e:  # a key holding the wrong kind of value
        raise ValueError(f"config.json: a key has a value of the wrong type ({e})") from None
    for field in ("layers", "hidden", "heads", "kv_heads", "head_dim"):
        if getattr(spec, field) <= 0:
            raise ValueError(f"config.json: the model's {field} comes out as "
                             f"{getattr(spec, field)}; check the config's sizes")
    if not 0 < spec.active_params <= spec.params < float("inf"):
        raise ValueError(f"config.json: the sizes give {spec.params:g} parameters "
                         f"({spec.active_params:g} active); check the config's sizes")
    return spec


def _model_from_config(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    text = cfg.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ValueError("config.json: text_config must be an object")
    cfg = {**text, **cfg} if text else cfg
    hidden = _int(cfg, "hidden_size", "d_model")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(cfg, "num_attention_heads", "n_head")
    vocab = _int(cfg, "vocab_size")
    if not hidden or not layers or not heads:
        raise ValueError("config.json: hidden_size, num_hidden_layers and num_attention_heads "
                         "must be positive")
    attn, attn_fields = _attention(cfg, hidden, heads)
    mlp_total, mlp_active, experts, k = _mlp(cfg, hidden, layers)
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    norms = layers * 2 * hidden + hidden
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads,
        params=float(layers * attn + mlp_total + embed + norms),
        active_params=float(layers * attn + mlp_active + embed + norms),
        experts=experts, experts_per_token=k, weight_dtype=weight_dtype_of(cfg),
        kv_dtype=_TORCH_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or
                                       "bfloat16").lower().removeprefix("torch."), "bf16"),
        note="from config.json", **attn_fields)


def load_model_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """Read a config.json file (or a model directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"cannot read Hugging Face config {p}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"Hugging Face config {p} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"Hugging Face config {p} nests too deeply to be a config") from None
    default = cfg.get("_name_or_path") if isinstance(cfg, dict) else None
    return model_from_config(cfg, name or default or p.parent.name)
