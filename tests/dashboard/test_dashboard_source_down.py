"""The dashboard pointed at an exporter that is down (issue 37, the first hour): its
figures say there is no data, without Plotly's empty axes, and its terminal says once
that the exporter does not answer, with the URL and why, and once that it answers
again. A real dead port, the page's own callback, a real exporter brought up on it."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from phasewatch.app import Exporter
from phasewatch.config import ServeConfig
from phasewatch.dashboard.app import GRAPHS, create_app
from phasewatch.dashboard.exporter_source import ExporterSource
from tests.conftest import TEST_PORTS, terminate

REFRESH = 0.2  # the page's cache keeps an answer for half of it


def dead_port() -> int:
    """A port nothing listens on (bound by the OS a moment ago, then closed)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def callback_body(dependencies: list[dict]) -> dict:
    """The page's refresh, as the browser asks for it on a tick: the callback whose
    outputs start with the state panel, every input unset but the tick."""
    dep = next(d for d in dependencies if d["output"].startswith("..state.children"))
    outputs = [dict(zip(("id", "property"), o.rsplit(".", 1), strict=True))
               for o in dep["output"].strip(".").split("...")]
    inputs = [{**i, "value": 1 if i["id"] == "tick" else None} for i in dep["inputs"]]
    return {"output": dep["output"], "outputs": outputs, "inputs": inputs,
            "changedPropIds": ["tick.n_intervals"], "state": []}


def refresh_in_process(client) -> dict:
    deps = json.loads(client.get("/_dash-dependencies").data)
    r = client.post("/_dash-update-component", json=callback_body(deps))
    assert r.status_code == 200, r.data
    return json.loads(r.data)["response"]


def graphs_of(node):
    """(id, figure) of every graph in the page's layout (Dash's JSON of it)."""
    if isinstance(node, dict):
        props = node.get("props", {})
        if node.get("type") == "Graph":
            yield props["id"], props.get("figure")
        for child in node.values():
            yield from graphs_of(child)
    elif isinstance(node, list):
        for child in node:
            yield from graphs_of(child)


def no_axes(figure: dict) -> bool:
    layout = figure["layout"]
    return (figure["data"] == [] and layout["xaxis"] == {"visible": False}
            and layout["yaxis"] == {"visible": False})


def test_figures_show_the_message_without_axes_and_the_log_says_it_once(caplog):
    """Issue 37: each figure drew Plotly's empty axes (-1 to 6) under the page's
    message, and the terminal said nothing at all."""
    port = dead_port()
    url = f"http://127.0.0.1:{port}"
    app = create_app(ExporterSource(url, timeout=2), refresh=REFRESH)
    client = app.server.test_client()
    graphs = dict(graphs_of(json.loads(client.get("/_dash-layout").data)))
    assert set(graphs) == {*GRAPHS, "slo"}
    for g in GRAPHS:  # before the first answer: a message, no axes
        assert no_axes(graphs[g]), graphs[g]
        (note,) = graphs[g]["layout"]["annotations"]
        assert note["text"] == "Waiting for the exporter's first answer"
    with caplog.at_level(logging.INFO, logger="phasewatch.dashboard"):
        for _ in range(4):
            page = refresh_in_process(client)
            time.sleep(REFRESH)
        assert "Exporter unreachable" in json.dumps(page["state"])
        for g in GRAPHS:
            fig = page[g]["figure"]
            assert no_axes(fig), fig
            (note,) = fig["layout"]["annotations"]
            assert note["text"] == ("No data: the exporter has not answered yet (see the "
                                    "message above)")
            assert fig["layout"]["title"]["text"]  # the figure's own title stays
        down = [r for r in caplog.records if r.name == "phasewatch.dashboard"]
        assert len(down) == 1 and down[0].levelno == logging.WARNING, down
        assert f"{url}/api/v1/summary" in down[0].getMessage()
        assert "cannot reach the exporter" in down[0].getMessage()
        caplog.clear()
        with Exporter(ServeConfig(**{**TEST_PORTS, "http_port": port})):
            for _ in range(3):
                page = refresh_in_process(client)
                time.sleep(REFRESH)
        up = [r for r in caplog.records if r.name == "phasewatch.dashboard"]
    assert [r.getMessage() for r in up] == [f"dashboard: the exporter at {url} answers again"]
    assert '"state-empty"' in json.dumps(page["state"])  # reachable, with no request yet
    for g in GRAPHS:  # each figure's own picture again ("No roofline yet: ...")
        assert "has not answered" not in json.dumps(page[g]["figure"])


def test_the_terminal_says_once_that_the_exporter_is_down_and_once_that_it_is_back():
    """``phasewatch dashboard --exporter URL`` as a user runs it: several refreshes of
    the page against a dead port, then an exporter on it."""
    port = dead_port()
    proc = subprocess.Popen([sys.executable, "-m", "phasewatch.cli", "dashboard",
                             "--exporter", f"http://127.0.0.1:{port}", "--port", "0",
                             "--refresh", str(REFRESH)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        m = re.search(r"phasewatch dashboard on (http://\S+) ", proc.stdout.readline())
        assert m
        page = m.group(1).rstrip("/")
        with urllib.request.urlopen(page + "/_dash-dependencies", timeout=10) as r:
            body = json.dumps(callback_body(json.load(r))).encode()

        def refresh() -> None:
            req = urllib.request.Request(page + "/_dash-update-component", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200
            time.sleep(REFRESH)

        for _ in range(5):
            refresh()
        with Exporter(ServeConfig(**{**TEST_PORTS, "http_port": port})):
            for _ in range(3):
                refresh()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        terminate(proc)
    err = proc.stderr.read()
    lines = [line for line in err.splitlines() if "phasewatch.dashboard" in line]
    assert len(lines) == 2, err
    assert f"http://127.0.0.1:{port}/api/v1/summary: cannot reach the exporter" in lines[0]
    assert "WARNING" in lines[0]
    assert lines[1].endswith(f"dashboard: the exporter at http://127.0.0.1:{port} answers "
                             "again")
    assert "Traceback" not in err
