"""Every serve option's default agrees between options.SERVE_OPTIONS and the dataclasses
(ServeConfig, ModelOptions), and the check runs under ``python -O`` as well."""

import subprocess
import sys

from phasewatch.config import MODEL_KEYS, ModelOptions, ServeConfig
from phasewatch.options import SERVE_OPTIONS


def test_dataclass_defaults_match_the_table():
    conf, model = ServeConfig(), ModelOptions()
    for o in SERVE_OPTIONS:
        owner = model if o.name in MODEL_KEYS else conf
        assert getattr(owner, o.name) == o.default, o.name


def test_table_check_survives_python_O():
    out = subprocess.run([sys.executable, "-O", "-c", "import phasewatch.config"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
