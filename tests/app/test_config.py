"""Configuration precedence: defaults < file < PHASEWATCH_* < flags."""

import argparse

import pytest

from phasewatch.config import ConfigError, add_serve_flags, load_serve_config


def parse(argv):
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    return p.parse_args(argv)


def test_precedence(tmp_path):
    cfg = tmp_path / "pw.toml"
    cfg.write_text("[serve]\ngrpc_port = 1111\nhttp_port = 2222\nwindow_seconds = 10\n")
    env = {"PHASEWATCH_HTTP_PORT": "3333"}
    c = load_serve_config(parse(["--config", str(cfg), "--window-seconds", "20"]), env)
    assert (c.grpc_port, c.http_port, c.window_seconds) == (1111, 3333, 20.0)
    assert load_serve_config(parse([]), {}).grpc_port == 50051


def test_errors_say_how_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_serve_config(parse(["--config", str(tmp_path / "missing.toml")]), {})
    bad = tmp_path / "bad.toml"
    bad.write_text("grpc_port = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_serve_config(parse(["--config", str(bad)]), {})
    with pytest.raises(ConfigError, match="PHASEWATCH_GRPC_PORT: grpc_port must be int"):
        load_serve_config(parse([]), {"PHASEWATCH_GRPC_PORT": "x"})
    with pytest.raises(ConfigError, match="lifecycle_grace must not exceed"):
        load_serve_config(parse(["--lifecycle-grace", "20", "--lifecycle-ttl", "10"]), {})


def test_models_tables_and_single_model_flags(tmp_path):
    cfg = tmp_path / "pw.toml"
    cfg.write_text('[serve]\nhttp_port = 0\n\n[[models]]\nmodel = "Llama-3.1-70B"\n'
                   'hardware = "H200"\ngpus = 4\nkv_dtype = "fp8"\n\n'
                   '[[models]]\nhf_config = "/models/mixtral/config.json"\n'
                   'served_model_name = "mixtral"\nhardware = "H100-SXM"\n')
    c = load_serve_config(parse(["--config", str(cfg), "--model", "Llama-3.1-8B",
                                 "--hardware", "L4"]), {})
    opts = c.model_options()
    assert [(o.model or o.served_model_name, o.hardware, o.gpus) for o in opts] == [
        ("Llama-3.1-70B", "H200", 4), ("mixtral", "H100-SXM", 0), ("Llama-3.1-8B", "L4", 0)]
    assert opts[0].kv_dtype == "fp8"
    bad = tmp_path / "bad.toml"
    bad.write_text('[[models]]\nmodel = "x"\nhardwre = "H100"\n')
    with pytest.raises(ConfigError, match=r"\[\[models\]\] #1: unknown keys \['hardwre'\]"):
        load_serve_config(parse(["--config", str(bad)]), {})
    bad.write_text('[[models]]\nmodel = "x"\ngpus = "four"\n')
    with pytest.raises(ConfigError, match="gpus must be int"):
        load_serve_config(parse(["--config", str(bad)]), {})


def test_boolean_options():
    assert load_serve_config(parse(["--pod-label", "true"]), {}).pod_label is True
    assert load_serve_config(parse([]), {"PHASEWATCH_POD_LABEL": "no"}).pod_label is False
    with pytest.raises(ConfigError, match="pod_label must be bool"):
        load_serve_config(parse(["--pod-label", "maybe"]), {})
