"""Hugging Face config.json -> ModelSpec, against the published model cards."""

from __future__ import annotations

import json

import pytest

from phasewatch.roofline import model_costs
from phasewatch.roofline.hf_config import load_model_config, model_from_config
from tests import support

FIXTURES = support.FIXTURES / "hf"


@pytest.mark.parametrize("name,params_b,active_b,dtype,experts", [
    ("llama-3.1-8b-instruct", 8.03, 8.03, "bf16", 0),   # card: 8.03B
    ("mixtral-8x7b-instruct", 46.7, 12.9, "bf16", 8),   # card: 46.7B total, 12.9B active
    ("deepseek-v3", 671.0, 37.5, "fp8", 256),            # card: 671B (+14B MTP), 37B active
    ("qwen2.5-7b-instruct-awq", 7.62, 7.62, "int4", 0),  # card: 7.61B
    # card: 116.8B total; its 5.1B active leaves out the input embedding, counted here
    ("gpt-oss-120b", 116.8, 5.7, "mxfp4", 128),
])
def test_parameter_counts_match_the_model_cards(name, params_b, active_b, dtype, experts):
    m = load_model_config(FIXTURES / f"{name}.json", name)
    assert m.params / 1e9 == pytest.approx(params_b, rel=0.01)
    assert m.active_params / 1e9 == pytest.approx(active_b, rel=0.02)
    assert m.weight_dtype == dtype
    assert m.experts == experts


def test_gqa_and_mla_kv_cache_sizes():
    llama = load_model_config(FIXTURES / "llama-3.1-8b-instruct.json")
    # 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes
    assert model_costs.kv_bytes_per_token(llama) == 2 * 32 * 8 * 128 * 2
    ds = load_model_config(FIXTURES / "deepseek-v3.json")
    # MLA caches one latent of kv_lora_rank + qk_rope_head_dim = 576 per layer
    assert ds.kv_dim_per_layer == 576 and ds.head_dim == 192 and ds.v_head_dim == 128
    assert model_costs.kv_bytes_per_token(ds) == 61 * 576 * 2


def test_directory_name_and_dtype_sources(tmp_path):
    cfg = json.loads((FIXTURES / "llama-3.1-8b-instruct.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "float16"}))
    m = load_model_config(tmp_path)
    assert m.weight_dtype == "fp16" and m.name == tmp_path.name
    q = cfg | {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float"}}}}}
    assert model_from_config(q, "x").weight_dtype == "fp8"
    tied = model_from_config(cfg | {"tie_word_embeddings": True}, "x")
    assert tied.params == pytest.approx(8.03e9 - 128256 * 4096, rel=0.001)


def test_bad_configs_say_what_is_wrong(tmp_path):
    cfg = json.loads((FIXTURES / "llama-3.1-8b-instruct.json").read_text())
    with pytest.raises(ValueError, match="missing hidden_size"):
        model_from_config({k: v for k, v in cfg.items() if k != "hidden_size"}, "x")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        model_from_config(cfg | {"num_key_value_heads": 5}, "x")
    with pytest.raises(ValueError, match="num_hidden_layers must be a non-negative integer"):
        model_from_config(cfg | {"num_hidden_layers": "32"}, "x")
    with pytest.raises(ValueError, match="unsupported torch_dtype"):
        model_from_config(cfg | {"torch_dtype": "complex64"}, "x")
    with pytest.raises(ValueError, match="cannot read Hugging Face config"):
        load_model_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_config(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="JSON object"):
        model_from_config([1, 2], "x")
