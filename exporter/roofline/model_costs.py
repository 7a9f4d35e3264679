"""Bytes and FLOPs that one engine step moves, per model, from its architecture.

Shared by the simulator's cost model (ground truth) and the roofline estimator.
Conventions, stated once:

* Weights are read once per engine step and shared by the whole batch
  (docs/verdict.md). For a MoE model a step reads the shared (always
  active) weights plus every expert that at least one token of the step routes
  to; with uniform routing the expected number of distinct experts hit by ``t``
  tokens choosing ``k`` of ``E`` is ``E * (1 - (1 - k/E)**t)`` per layer.
* KV cache per token = 2 (K and V) x layers x kv_heads x head_dim x kv_bytes
  (Llama-2-70B fp16 -> 327,680 B; Databricks: 0.312 GiB at 1024). For MLA models the
  cache holds one latent of ``kv_dim_per_layer`` elements per layer instead.
* FLOPs per token = 2 x active params (one multiply-add per weight) plus attention
  2 x layers x heads x (d_qk + d_v) x context (QK^T and AV). Prefill attention is
  counted **causally** (token i attends to i+1 positions, the n^2/2 that
  FlashAttention's causal kernels actually compute, as MaxText counts it; vLLM's
  estimator counts the full n^2). Decode attends to the whole context either way.
"""

from __future__ import annotations

import numpy as np

from phasewatch.roofline.catalog import ModelSpec, dtype_bytes


def kv_bytes_per_token(m: ModelSpec) -> float:
    """KV-cache bytes one token of context occupies (and a decode step reads)."""
    per_layer = m.kv_dim_per_layer if m.kv_dim_per_layer else 2 * m.kv_heads * m.head_dim
    return m.layers * per_layer * dtype_bytes(m.kv_dtype)


def weight_bytes(m: ModelSpec) -> float:
    """Bytes of all weights as stored."""
    return m.params * dtype_bytes(m.weight_dtype)


def weight_bytes_read(m: ModelSpec, tokens_in_step: np.ndarray | float) -> np.ndarray | float:
    """Weight bytes one step reads when it processes ``tokens_in_step`` tokens."""
    b = dtype_bytes(m.weight_dtype)
    if not m.is_moe:
        return m.params * b * np.ones_like(np.asarray(tokens_in_step, dtype=float))
    per_expert = (m.params - m.active_params) / (m.experts - m.experts_per_token)
    shared = m.active_params - m.experts_per_token * per_expert
    t = np.maximum(np.asarray(tokens_in_step, dtype=float), 1.0)
    hit = m.experts * (1.0 - (1.0 - m.experts_per_token / m.experts) ** t)
    return (shared + hit * per_expert) * b


def attention_flops_per_context_token(m: ModelSpec) -> float:
    """Attention FLOPs of one query token per context token it attends to."""
    d_v = m.v_head_dim or m.head_dim
    return 2.0 * m.layers * m.heads * (m.head_dim + d_v)


def decode_flops(m: ModelSpec, context: np.ndarray | float) -> np.ndarray | float:
    """FLOPs of one decode token attending to ``context`` earlier tokens (itself included)."""
    return 2.0 * m.active_params + attention_flops_per_context_token(m) * np.asarray(context)


def prefill_flops(m: ModelSpec, tokens: np.ndarray | float, start: np.ndarray | float = 0):
    """FLOPs to prefill ``tokens`` new tokens after ``start`` tokens already in the cache.

    Causal: the i-th new token (0-based) attends to start + i + 1 positions, so the
    attention term is tokens*start + tokens*(tokens+1)/2 context-token products.
    """
    n = np.asarray(tokens, dtype=float)
    s = np.asarray(start, dtype=float)
    pairs = n * s + n * (n + 1) / 2.0
    return 2.0 * m.active_params * n + attention_flops_per_context_token(m) * pairs
