"""Configuration precedence: defaults < file < PHASEWATCH_* < flags."""

import argparse

import pytest

from exporter.config import ConfigError, add_serve_flags, load_serve_config


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
