"""Every option's default is written once, in its table (``options``,
``options_commands``): the records take their fields from it (``ServeConfig``,
``ModelOptions``, ``TapConfig``), every command's parser is built from it, and a default
changed there shows in the records and in ``--help`` alike."""

import argparse
import json
import subprocess
import sys
import textwrap

from phasewatch.cli import build_parser
from phasewatch.config import MODEL_KEYS, ModelOptions, ServeConfig
from phasewatch.options import (
    DASHBOARD_OPTIONS,
    DEMO_OPTIONS,
    SERVE_OPTIONS,
    SERVE_TAP,
    TAP_OPTIONS,
)
from phasewatch.options_commands import (
    CALIBRATE_OPTIONS,
    DASHBOARD_CLIENT,
    DASHBOARD_SOURCE,
    DEMO_SIM_OPTIONS,
    ROOFLINE_OPTIONS,
    SIMULATE_OPTIONS,
    TAP_CLIENT,
)
from phasewatch.tap import TapConfig
from tests.support import ROOT


def test_dataclass_defaults_match_the_table():
    conf, model, tap = ServeConfig(), ModelOptions(), TapConfig()
    for o in SERVE_OPTIONS:
        if o in SERVE_TAP:  # serve's --tap-NAME: its tap's NAME
            assert getattr(conf.tap, o.name.removeprefix("tap_")) == o.default, o.name
        else:
            owner = model if o.name in MODEL_KEYS else conf
            assert getattr(owner, o.name) == o.default, o.name
    for o in TAP_OPTIONS:
        assert getattr(tap, o.name) == o.default, o.name


def test_table_check_survives_python_O():
    out = subprocess.run([sys.executable, "-O", "-c", "import phasewatch.config"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# Changes a default in each table before the records and the parser are made from them,
# then reads them back: the records' defaults, serve's loaded settings, --help
CHANGED = textwrap.dedent("""
    import contextlib, io, json
    from phasewatch import options

    def change(table, name, value):
        o = next(o for o in table if o.name == name)
        object.__setattr__(o, "default", value)  # the table is frozen; a test may

    change(options.SERVE_OPTIONS, "grpc_port", 50999)
    change(options.MODEL_OPTIONS, "max_batched_tokens", 4096)
    change(options.TAP_OPTIONS, "port", 8999)
    change(options.SERVE_TAP, "tap_port", 8999)  # serve's copy of the tap's
    from phasewatch import options_commands
    change(options_commands.CALIBRATE_OPTIONS, "repeats", 7)
    from phasewatch.cli import build_parser
    from phasewatch.config import ServeConfig, load_serve_config
    from phasewatch.roofline.deployments import ModelOptions
    from phasewatch.tap import TapConfig

    def helped(command):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            build_parser().parse_args([command, "--help"])
        return " ".join(out.getvalue().split())

    loaded = load_serve_config(None, {})
    print(json.dumps({
        "records": [ServeConfig().grpc_port, ModelOptions().max_batched_tokens,
                    TapConfig().port, ServeConfig().tap.port],
        "loaded": [loaded.grpc_port, loaded.model_flags.max_batched_tokens, loaded.tap.port],
        "calibrate": build_parser().parse_args(["calibrate"]).repeats,
        "serve": helped("serve"), "tap": helped("tap"), "calibrate_help": helped("calibrate"),
    }))
""")


def test_a_default_changed_in_the_table_shows_in_the_records_and_the_help():
    out = subprocess.run([sys.executable, "-c", CHANGED], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["records"] == [50999, 4096, 8999, 8999]
    assert got["loaded"] == [50999, 4096, 8999]
    assert got["calibrate"] == 7
    assert "(0 = pick a free one) (default 50999; env PHASEWATCH_GRPC_PORT)" in got["serve"]
    assert "(default 4096; env PHASEWATCH_MAX_BATCHED_TOKENS)" in got["serve"]
    assert "(default 8999; env PHASEWATCH_TAP_PORT)" in got["serve"]  # --tap-port
    assert "(default 8999; env PHASEWATCH_TAP_PORT)" in got["tap"]  # --port
    assert "best of this many runs (default 7)" in got["calibrate_help"]


# each command's flags and the tables they are built from
TABLES = {
    "serve": (SERVE_OPTIONS,),
    "simulate": (SIMULATE_OPTIONS,),
    "demo": (DEMO_OPTIONS, DEMO_SIM_OPTIONS, SERVE_OPTIONS),
    "dashboard": (DASHBOARD_SOURCE, DASHBOARD_OPTIONS, DASHBOARD_CLIENT),
    "roofline": (ROOFLINE_OPTIONS,),
    "tap": (TAP_OPTIONS, TAP_CLIENT),
    "calibrate": (CALIBRATE_OPTIONS,),
}


def test_every_flag_of_every_command_has_its_option_in_a_table():
    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(TABLES)
    for command, parser in sub.choices.items():
        options = {o.flag: o for table in TABLES[command] for o in table}
        shown = [a for a in parser._actions if a.help is not argparse.SUPPRESS
                 and a.option_strings[0] not in ("-h", "--config")]
        assert sorted(a.option_strings[0] for a in shown) == sorted(options), command
        serve = {o.flag for o in SERVE_OPTIONS}
        for a in shown:
            o = options[a.option_strings[0]]
            assert a.dest == o.name and o.help.replace("%", "%%") in a.help, (command, o.name)
            if command in ("serve", "demo") and o.flag in serve:
                assert a.default is None  # config.load_serve_config applies the table's
            else:
                assert getattr(a, "fallback", a.default) == o.default, (command, o.name)
                needed = a.required or getattr(a, "needed", False)  # flag (or variable)
                assert needed == (o.required and not o.one_of), (command, o.name)
        hidden = {a.option_strings[0] for a in parser._actions
                  if a.help is argparse.SUPPRESS and a.option_strings}
        assert hidden == {o.old for o in options.values() if o.old}, command


def test_the_dashboards_source_is_one_of_two_and_required(capsys):
    parser = build_parser()
    for args in (["dashboard"], ["dashboard", "--exporter", "http://a:1", "--prometheus",
                                 "http://b:2"]):
        try:
            parser.parse_args(args)
        except SystemExit:
            pass
        else:
            raise AssertionError(f"{args} parsed")
    err = capsys.readouterr().err
    assert "one of the arguments --exporter --prometheus is required" in err
    assert "not allowed with argument" in err
