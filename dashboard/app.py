"""The Dash app: layout, the one refresh callback, and a server with a real port.

``refresh`` seconds after the last refresh ended (and on any selector change) one
callback asks the source for a snapshot of the selection and rebuilds the banner, the
cards and the figures.
On a source error the figures keep their last picture and the banner says what
failed; nothing is cleared. A short cache shares one fetch among open tabs.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import dash
from dash import Input, Output, dcc, html
from werkzeug.serving import LISTEN_QUEUE, get_sockaddr, make_server, select_address_family

from phasewatch.dashboard import figures, panels
from phasewatch.dashboard.frames import Selection, Snapshot
from phasewatch.dashboard.layout import empty_figure
from phasewatch.dashboard.replica_panel import replica_tables, rule_text
from phasewatch.dashboard.theme import CAPTIONS, PAGE_CSS, PAGE_SCRIPT

log = logging.getLogger("phasewatch.dashboard")

GRAPHS = ("roofline", "prompt-ttft", "ttft-series", "token-latency", "throughput",
          "shares", "waterfall")
# Graphs on a row of their own (the waterfall: one bar per request, as tall as there are
# requests); the other six tile in one, two or three columns (theme.PAGE_CSS).
FULL_ROW = ("waterfall",)
# The mode bar without the box and lasso selections, which select nothing here.
GRAPH_CONFIG = {"displaylogo": False, "modeBarButtonsToRemove": ["select2d", "lasso2d"]}


@dataclass
class ScenarioControl:
    """The demo's scenario switch: ``switch(name)`` changes the simulated workload."""

    scenarios: tuple[str, ...]
    current: str
    switch: object  # callable(name) -> None
    switched_at: float | None = None  # Unix time of the last switch from the page


# After a switch the window still holds the previous scenario's requests; the verdict
# follows once the window has turned over and the roofline has been estimated again.
SWITCH_LAG_S = 10.0


def switch_note(scenario: ScenarioControl, window_seconds: float | None, now: float) -> str:
    """What the page says after a scenario switch, while the window still holds the
    previous scenario's requests (the banner would otherwise read as the new one's);
    "" before any switch and once the window has turned over."""
    if scenario.switched_at is None or not window_seconds:
        return ""
    settled = scenario.switched_at + window_seconds + SWITCH_LAG_S
    if now >= settled:
        return ""
    at, by = (time.strftime("%H:%M:%S", time.localtime(t))
              for t in (scenario.switched_at, settled))
    return (f"Switched to {scenario.current} at {at}. The banner, the cards and the "
            f"roofline cover the last {window_seconds:g} s, so until about {by} they still "
            "count the previous scenario's requests.")


@dataclass
class CachedSource:
    """One fetch per selection per ``ttl`` seconds, however many tabs refresh."""

    source: object
    ttl: float = 1.0
    _cache: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    last_ok: float | None = None
    window_seconds: float | None = None  # the last good snapshot's
    failing: str | None = None  # the kind of the source's error since its last answer

    def fetch(self, selection: Selection) -> Snapshot:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(selection)
            if hit and now - hit[0] < self.ttl:
                return hit[1]
        snap = self.source.fetch(selection)
        with self._lock:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[selection] = (now, snap)
            if snap.error is None:
                self.last_ok = snap.fetched_at
                self.window_seconds = snap.window_seconds
            self._log_change(snap)
        return snap

    def _log_change(self, snap: Snapshot) -> None:
        """A source that stops answering is logged once, with the URL and why, and once
        when it answers again: not at every refresh of every tab."""
        kind = None if snap.error is None else snap.error.kind
        if kind == self.failing:
            return
        self.failing = kind
        name = getattr(self.source, "name", snap.source)
        if snap.error is not None:
            log.warning("dashboard: %s: %s; retrying every refresh (logged again once it "
                        "answers)", snap.error.target, snap.error.message)
        else:
            log.info("dashboard: the %s at %s answers again", name, snap.target)


def build_figures(snap: Snapshot) -> list[dict]:
    """Every figure of the page, in ``GRAPHS`` order. A stopped workload's figures of
    the window say so where they are empty, not "yet" (the time series keep their
    history)."""
    idle = panels.idle_text(snap.window_seconds) if snap.idle else None
    return [figures.roofline_figure(snap.points, snap.ceilings, idle),
            figures.prompt_ttft_figure(snap.prompt_points, snap.prompt_classes, idle),
            figures.ttft_figure(snap.series), figures.token_latency_figure(snap.series),
            figures.throughput_figure(snap.series), figures.shares_figure(snap.series),
            figures.waterfall_figure(snap.waterfall, idle)]


def no_data_figures(message: str) -> list[dict]:
    """Every figure as its title over ``message``, with no axes: before the source has
    ever answered there is no picture to keep (Plotly's empty axes, -1 to 6, would read
    as data)."""
    return [empty_figure(fig["layout"]["title"]["text"], message)
            for fig in build_figures(Snapshot("", ""))]


def no_data_text(source_name: str) -> str:
    return f"No data: the {source_name} has not answered yet (see the message above)"


def page_outputs(snap: Snapshot, last_ok: float | None = None,
                 started: float | None = None) -> list:
    """State or banners, cards, the bench fold's blocks and its style, every figure,
    footer, the objectives' cards, figure and style, the replicas' tables and style: what
    one refresh sends the page.
    On a source error only the state and the footer change; the rest keeps its picture,
    and a figure that has none (the source never answered) says so, without axes.
    ``started``: ``perf_counter()`` when the refresh began (the footer shows its time)."""
    started = time.perf_counter() if started is None else started
    state = panels.state_panel(snap, last_ok)
    stamp = time.strftime("%H:%M:%S", time.localtime(snap.fetched_at))
    if snap.error is not None:
        figs = ([dash.no_update] * len(GRAPHS) if last_ok is not None
                else no_data_figures(no_data_text(snap.source)))
        return [state, *[dash.no_update] * 3, *figs,
                f"{stamp}: {snap.error.message}", *[dash.no_update] * 5]
    body = [state] if state is not None else panels.banners(snap)
    cards = panels.kpi_cards(snap.kpis) if not snap.kpis.empty else []
    bench = panels.bench_blocks(snap.kpis, snap.source)
    bench_style = {} if bench else {"display": "none"}
    figs = build_figures(snap)
    took = (time.perf_counter() - started) * 1000
    footer = (f"Updated {stamp} from {snap.source} {snap.target}; window "
              f"{snap.window_seconds:g} s; refresh took {took:.0f} ms on the server.")
    return [body, cards, bench, bench_style, *figs, footer, *slo_outputs(snap),
            *replica_outputs(snap)]


def slo_outputs(snap: Snapshot) -> list:
    """The objectives' section: its cards, its figure and its style (shown only where a
    selected label set has objectives)."""
    if not panels.has_objectives(snap.kpis):
        return [[], dash.no_update, {"display": "none"}]
    return [panels.slo_cards(snap.kpis), figures.slo_figure(snap.series), {}]


def replica_outputs(snap: Snapshot) -> list:
    """The Replicas section: a table per label set that two pods or more serve, and its
    style (shown only then)."""
    tables = replica_tables(snap.replicas)
    return [tables, {} if tables else {"display": "none"}]


def _options(values, chosen) -> list[dict]:
    return [{"label": v, "value": v} for v in sorted(set(values) | set(chosen or ())) if v]


def _shown(options: list) -> dict:
    """An optional selector (pod, request source) shows once it has a choice to offer."""
    return {} if options else {"display": "none"}


def _selector(id_: str, placeholder: str) -> dcc.Dropdown:
    return dcc.Dropdown(id=id_, multi=True, placeholder=placeholder, options=[],
                        persistence=True, className="pw-select")


MAX_BODY_BYTES = 256 * 1024  # a callback's request is a few KB; Flask answers 413 past it


def guard(server, basic_auth: str = "") -> None:
    """Read-only, and optionally behind HTTP basic auth (``user:password``): the page and
    its assets are GETs; the only POST is Dash's own callback endpoint, whose body is
    capped at MAX_BODY_BYTES; anything else is 405."""
    import hmac

    from flask import Response, request

    server.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    user, _, password = basic_auth.partition(":")
    if basic_auth and (not user or not password):
        raise ValueError("basic auth must be user:password")

    @server.before_request
    def _check():
        if basic_auth:
            given = request.authorization
            ok = (given is not None and given.type == "basic" and
                  hmac.compare_digest((given.username or "").encode(), user.encode()) &
                  hmac.compare_digest((given.password or "").encode(), password.encode()))
            if not ok:
                log.warning("dashboard: refused %s %s from %s (basic auth)", request.method,
                            request.path, request.remote_addr)
                return Response("phasewatch dashboard: log in\n", 401,
                                {"WWW-Authenticate": 'Basic realm="phasewatch"'})
        if request.method in ("GET", "HEAD", "OPTIONS"):
            return None
        if request.method == "POST" and request.path.endswith("/_dash-update-component"):
            return None
        return Response("phasewatch dashboard is read-only\n", 405, {"Allow": "GET, HEAD"})


def _layout(source, refresh: float, scenario: ScenarioControl | None) -> html.Div:
    controls = [_selector("model", "all models"), _selector("engine", "all engines"),
                html.Div(_selector("pod", "all pods"), id="pod-wrap",
                         style={"display": "none"}),
                # who saw the requests (id "source" is the header line naming the exporter)
                html.Div(_selector("request-source", "all sources"), id="request-source-wrap",
                         style={"display": "none"})]
    if scenario is not None:
        controls.append(html.Div([html.Span("scenario ", style={"fontSize": "13px"}),
                                  dcc.Dropdown(id="scenario", value=scenario.current,
                                               clearable=False, className="pw-select",
                                               options=[{"label": s, "value": s}
                                                        for s in scenario.scenarios])],
                                 style={"display": "flex", "alignItems": "center"}))
    return html.Div([
        html.Div([html.H1("phasewatch"),
                  html.Span(f"{source.name} {source.url}", className="pw-source",
                            id="source"),
                  html.Div(controls, className="pw-selectors")], className="pw-header"),
        html.Div([
            html.Div(id="scenario-note", className="pw-note", style={"display": "none"}),
            html.Div(id="state"),
            html.Div(id="cards", className="pw-cards"),
            html.Div([html.Div(id="slo-cards", className="pw-cards"),
                      html.Div([dcc.Graph(id="slo", config=GRAPH_CONFIG),
                                html.P(CAPTIONS["slo"], className="pw-caption")],
                               className="pw-slo-panel", id="panel-slo")],
                     id="slo-section", className="pw-slo", style={"display": "none"}),
            html.Div([html.Div(id="replica-tables"),
                      html.P(f"{CAPTIONS['replicas']} {rule_text()}", className="pw-caption")],
                     id="replicas", className="pw-replicas", style={"display": "none"}),
            panels.bench_compare(),
            html.Div([html.Div([dcc.Graph(id=g, config=GRAPH_CONFIG, figure=first),
                                html.P(CAPTIONS[g], className="pw-caption")],
                               className="pw-panel pw-full-row" if g in FULL_ROW
                               else "pw-panel", id=f"panel-{g}")
                      for g, first in zip(GRAPHS, no_data_figures(
                          f"Waiting for the {source.name}'s first answer"), strict=True)],
                     className="pw-grid"),
        ], className="pw-main"),
        html.Div(id="footer", className="pw-footer"),
        dcc.Interval(id="tick", interval=int(refresh * 1000)),
    ])


def create_app(source, refresh: float = 2.0, scenario: ScenarioControl | None = None,
               basic_auth: str = "") -> dash.Dash:
    """``source`` has ``fetch(Selection) -> Snapshot``, ``name`` and ``url``. The pod
    selector shows once the source reports pods (Prometheus, or a central exporter), the
    request-source selector (engine, tap, joined) once it reports sources (an exporter
    run with --source-label).
    ``basic_auth``: ``user:password`` the browser must give (empty: none)."""
    cached = CachedSource(source, ttl=min(1.0, refresh / 2))
    app = dash.Dash("phasewatch", title="phasewatch", update_title=None,
                    serve_locally=True)
    guard(app.server, basic_auth)
    app.index_string = app.index_string.replace(
        "{%css%}", "{%css%}<style>" + PAGE_CSS + "</style><script>" + PAGE_SCRIPT + "</script>")

    def page() -> html.Div:
        """The layout, built on every page load: the scenario dropdown shows the live
        scenario, not the one the demo started with."""
        return _layout(source, refresh, scenario)

    app.layout = page

    @app.callback([Output("state", "children"), Output("cards", "children"),
                   Output("bench-blocks", "children"), Output("bench-compare", "style"),
                   *[Output(g, "figure") for g in GRAPHS], Output("footer", "children"),
                   Output("slo-cards", "children"), Output("slo", "figure"),
                   Output("slo-section", "style"),
                   Output("replica-tables", "children"), Output("replicas", "style"),
                   Output("model", "options"), Output("engine", "options"),
                   Output("pod", "options"), Output("pod-wrap", "style"),
                   Output("request-source", "options"), Output("request-source-wrap", "style")],
                  [Input("tick", "n_intervals"), Input("model", "value"),
                   Input("engine", "value"), Input("pod", "value"),
                   Input("request-source", "value")],
                  # the tick waits while a refresh runs: Dash drops the answer of a
                  # callback in flight when the same callback is asked again, so a source
                  # slower than the refresh would otherwise never update the page
                  running=[(Output("tick", "disabled"), True, False)])
    def refresh_page(_, models, engines, pods, sources):
        started = time.perf_counter()
        selection = Selection(tuple(models or ()), tuple(engines or ()), tuple(pods or ()),
                              tuple(sources or ()))
        snap = cached.fetch(selection)
        page = page_outputs(snap, cached.last_ok, started)
        if snap.error is not None:  # keep the selectors as they were
            return [*page, *[dash.no_update] * 6]
        models, engines, pods, sources = (
            _options(snap.labels[k].tolist(), chosen)
            for k, chosen in (("model", models), ("engine", engines), ("pod", pods),
                              ("source", sources)))
        return [*page, models, engines, pods, _shown(pods), sources, _shown(sources)]

    if scenario is not None:
        @app.callback([Output("scenario-note", "children"), Output("scenario-note", "style")],
                      [Input("scenario", "value"), Input("tick", "n_intervals")])
        def switch_scenario(name, _):
            if dash.ctx.triggered_id == "scenario" and name and name != scenario.current:
                scenario.switch(name)
                scenario.current = name
                scenario.switched_at = time.time()
            note = switch_note(scenario, cached.window_seconds, time.time())
            return note, {} if note else {"display": "none"}

    return app


def dashboard_socket(host: str, port: int) -> socket.socket:
    """The dashboard's listening socket (port 0: a free one). A port that cannot be
    bound raises OSError, which the commands report naming their flag: Werkzeug's own
    bind prints two lines of its own and exits the process."""
    family = select_address_family(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Werkzeug's
        sock.bind(get_sockaddr(host, port, family))
        sock.listen(LISTEN_QUEUE)
    except BaseException:
        sock.close()
        raise
    return sock


class DashboardServer:
    """The app on a real socket (port 0 picks one; ``sock``: one ``dashboard_socket``
    bound already), served from a thread."""

    def __init__(self, app: dash.Dash, host: str = "127.0.0.1", port: int = 8050,
                 sock: socket.socket | None = None):
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
        sock = sock or dashboard_socket(host, port)
        try:
            self._server = make_server(host, port, app.server, threaded=True,
                                       fd=sock.fileno())
        finally:
            sock.close()  # the server holds a duplicate of it
        self.host = host
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="pw-dashboard", daemon=True)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> DashboardServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
