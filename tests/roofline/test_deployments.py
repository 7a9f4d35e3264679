"""Model x hardware resolution: catalog, config.json, profiles, NVML, and their errors."""

from __future__ import annotations

import json
import logging

import pytest

from phasewatch.roofline import catalog
from phasewatch.roofline.deployments import (
    PROFILE_FORMAT,
    Deployments,
    ModelNames,
    ModelOptions,
    load_profile,
    resolve,
)
from tests.support import FIXTURES

HF = FIXTURES / "hf"


def test_hugging_face_id_and_overrides_resolve():
    d = resolve(ModelOptions(model="meta-llama/Llama-3.1-8B-Instruct", hardware="h100",
                             tensor_parallel=2, weight_dtype="FP8", kv_dtype="fp8"))
    assert d.model.name == "Llama-3.1-8B" and d.served_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert (d.hardware.name, d.hardware.gpus, d.tensor_parallel) == ("H100-SXM", 2, 2)
    assert (d.model.weight_dtype, d.model.kv_dtype, d.compute_dtype) == ("fp8", "fp8", "fp8")
    assert d.peak_flops == 2 * 1979e12 and d.peak_bandwidth == 2 * 3350e9


def test_config_json_resolves():
    d = resolve(ModelOptions(hf_config=str(HF / "mixtral-8x7b-instruct.json"),
                             served_model_name="mixtral", hardware="H200", gpus=2))
    assert d.model_source == "hf_config" and d.model.experts == 8
    assert d.served_name == "mixtral" and d.hardware.gpus == 2


@pytest.mark.parametrize("options,message", [
    (ModelOptions(model="Llama-3.1-8", hardware="H100-SXM"),
     "unknown model 'Llama-3.1-8'; close matches: Llama-3.1-8B"),
    (ModelOptions(model="my-own-finetune-7b", hardware="H100-SXM"),  # issue 26: the way out
     "; or give the model's Hugging Face config.json with --hf-config$"),
    (ModelOptions(model="Llama-3.1-8B", hardware="H10"),
     "unknown hardware 'H10'; close matches: H100-SXM"),
    (ModelOptions(model="Llama-3.1-8B", hardware="H100", weight_dtype="int3"),
     "unknown dtype 'int3'; use one of"),
    (ModelOptions(model="Llama-3.1-8B", hardware="A100", compute_dtype="fp8"),
     "A100-80GB-SXM has no fp8 FLOP/s figure"),
    (ModelOptions(hardware="H100"), "needs `model`"),
    (ModelOptions(model="Llama-3.1-8B", hardware_profile="/nonexistent/profile.json"),
     "cannot read hardware profile"),
])
def test_bad_configuration_fails_with_the_fix(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        resolve(options)


@pytest.mark.parametrize("nvml_name,part", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA A100-SXM4-80GB", "A100-80GB-SXM"),
    ("NVIDIA H200", "H200"), ("NVIDIA L4", "L4"), ("Tesla T4", "T4"),
    ("NVIDIA A10G", "A10G"), ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"),
])
def test_nvml_device_names_are_catalog_aliases(nvml_name, part):
    assert catalog.hardware(nvml_name).name == part


def test_no_nvml_means_no_roofline_and_a_log_line(caplog):
    # On this GPU-less machine the real nvidia-ml-py cannot find libnvidia-ml.
    with caplog.at_level(logging.WARNING, logger="phasewatch"):
        assert resolve(ModelOptions(model="Llama-3.1-8B")) is None
    assert ("no roofline for Llama-3.1-8B: the hardware is missing, not given (--hardware, "
            "--hardware-profile) and not detected") in caplog.text
    assert "--hardware NAME" in caplog.text and "`phasewatch calibrate" in caplog.text


def _profile(tmp_path, **changes):
    data = {"format": PROFILE_FORMAT, "part": "H100-SXM", "device": "NVIDIA H100 80GB HBM3",
            "devices": 1, "measured": {"bandwidth_gbps": 2900.0, "flops_tflops": {"bf16": 750.0}}}
    data.update(changes)
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(data))
    return p


def test_profiles_of_known_and_unknown_parts(tmp_path):
    hw = load_profile(_profile(tmp_path), gpus=2)
    assert hw.bandwidth == 2 * 3350e9 and hw.measured_bandwidth == 2 * 2900e9
    assert hw.achievable_flops("bf16") == 2 * 750e12
    cpu = load_profile(_profile(tmp_path, part=None, device="AMD EPYC 7B13 (2 cores)",
                                measured={"bandwidth_gbps": 12.0,
                                          "flops_tflops": {"fp32": 0.1}}), gpus=1)
    assert cpu.name == "AMD EPYC 7B13 (2 cores)" and cpu.bandwidth == 12e9
    assert hw.datasheet and not cpu.datasheet  # a CPU's peaks are its measured figures
    assert not hw.cpu and not cpu.cpu  # a profile that does not say where it measured
    measured_here = load_profile(_profile(tmp_path, part=None, device="AMD EPYC",
                                          method={"device": "cpu"}), gpus=1)
    assert measured_here.cpu  # calibrate's own profile of a CPU: no CUDA-graph levers
    d = resolve(ModelOptions(model="Llama-3.1-8B", hardware_profile=str(_profile(tmp_path)),
                             gpus=1))
    assert d.hardware_source == "profile" and d.hardware.measured_bandwidth == 2900e9
    with pytest.raises(ValueError, match="not a phasewatch hardware profile"):
        load_profile(_profile(tmp_path, format="x"), 1)
    with pytest.raises(ValueError, match="lacks measured figures"):
        load_profile(_profile(tmp_path, measured={}), 1)


def test_requests_find_their_deployment_by_name_or_alias():
    d8 = resolve(ModelOptions(model="Llama-3.1-8B", hardware="H100"))
    d70 = resolve(ModelOptions(model="Llama-3.1-70B", served_model_name="big", hardware="H200",
                               gpus=4))
    ds = Deployments([d8, d70])
    assert ds.for_model("Llama-3.1-8B") is d8
    assert ds.for_model("meta-llama/Llama-3.1-8B-Instruct") is d8  # same catalog model
    assert ds.for_model("big") is d70
    assert ds.for_model("Llama-3.1-70B") is d70
    assert ds.for_model("mistralai/Mistral-7B-v0.1") is None  # not configured
    assert ds.for_model("some-unknown-model") is None


def test_every_name_of_a_configured_model_is_its_served_name():
    """Issue 26: one model, one label. The served name when set, else --model; hardware
    plays no part (auto, undetected here)."""
    names = ModelNames([ModelOptions(model="Llama-3.1-8B",
                                     served_model_name="meta-llama/Llama-3.1-8B-Instruct"),
                        ModelOptions(model="Mistral-7B")])
    for name in ("Llama-3.1-8B", "llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct",
                 "META-LLAMA/Meta-Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"):
        assert names(name) == "meta-llama/Llama-3.1-8B-Instruct", name
    assert names("mistralai/Mistral-7B-Instruct-v0.3") == "Mistral-7B"
    for other in ("Llama-3.1-70B", "some-unknown-model", "", "__overflow__"):
        assert names(other) == other  # no configured model's: as it is
    assert names.single == ""  # two models: spans without a model are not guessed


def test_a_name_two_configured_models_share_is_left_as_it_is():
    names = ModelNames([ModelOptions(model="Llama-3.1-8B", served_model_name="chat"),
                        ModelOptions(model="Llama-3.1-8B", served_model_name="batch")])
    assert (names("chat"), names("batch")) == ("chat", "batch")
    assert names("Llama-3.1-8B") == "Llama-3.1-8B"
    assert names("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"


def test_a_config_json_model_is_named_by_its_config_unless_served_otherwise():
    config = str(HF / "llama-3.1-8b-instruct.json")
    names = ModelNames([ModelOptions(hf_config=config)])
    label = names.single
    assert label == resolve(ModelOptions(hf_config=config, hardware="H100")).served_name
    assert names(label) == label
    served = ModelNames([ModelOptions(hf_config=config, model="llama-8b",
                                      served_model_name="prod")])
    assert (served("llama-8b"), served.single) == ("prod", "prod")


def test_label_sets_name_every_row_by_its_models_label():
    from phasewatch.aggregation.labels import LabelSets
    from phasewatch.selfstats import SelfStats

    names = ModelNames([ModelOptions(model="Llama-3.1-8B")])
    labels = LabelSets(SelfStats(), model_names=names)
    assert labels.index("meta-llama/Llama-3.1-8B-Instruct", "vllm") == labels.index(
        "Llama-3.1-8B", "vllm")
    assert labels.pairs() == [("Llama-3.1-8B", "vllm")]


def test_a_servers_own_name_for_the_configured_model_is_it(tmp_path, caplog):
    """Issue 36: transformers serve answers as <dir>@main, vLLM serving a directory with
    its path; --hf-config names the model by its directory. A path or a revision apart,
    or with one model configured, it is that model (logged once); a name the catalog
    knows as another model is not, nor any name that matches none of several configured
    models: each logged once with the configured names, and counted."""
    from phasewatch.aggregation.labels import LabelSets
    from phasewatch.selfstats import SelfStats

    model = tmp_path / "models" / "my-llama"
    model.mkdir(parents=True)
    (model / "config.json").write_text((HF / "llama-3.1-8b-instruct.json").read_text())
    names = ModelNames([ModelOptions(hf_config=str(model / "config.json"))])
    label = names.single
    for name in (f"{model}@main", str(model), "my-llama@v2", "/other/path/my-llama",
                 "whatever-the-client-said"):
        assert names.match(name) == (label, True), name
    assert names.match("mistralai/Mistral-7B-v0.1") == ("mistralai/Mistral-7B-v0.1", False)
    two = ModelNames([ModelOptions(model="Llama-3.1-8B"), ModelOptions(model="Qwen2.5-7B")])
    assert two.match("/models/Qwen2.5-7B@main") == ("Qwen2.5-7B", True)
    stats = SelfStats()
    labels = LabelSets(stats, model_names=two)
    with caplog.at_level(logging.WARNING, logger="phasewatch"):
        for _ in range(3):
            labels.index("gpt-x", "tap")
    assert stats.get("phasewatch_model_unmatched_requests_total") == 3
    told = [r.getMessage() for r in caplog.records if "gpt-x" in r.getMessage()]
    assert len(told) == 1 and "Llama-3.1-8B" in told[0] and "Qwen2.5-7B" in told[0], told
