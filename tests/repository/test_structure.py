"""The structure of the code, drawn from its imports: no circles, no import that runs back
up a floor, no module in the exporter over ~400 lines.

The floors are the stages of the data flow (docs/layout.md): a module may import its own
stage and the floors below it, never one above. Every import counts, a function-level one
too (a lazy import hides a circle, it does not remove it). Run
``python -m pytest -q tests/repository/test_structure.py`` to see the graph's figures (``-s``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support import ROOT

FOLDERS = {"phasewatch": ROOT / "exporter", "phasewatch.dashboard": ROOT / "dashboard"}
MAX_LINES = 420  # "about 400": a module past it has two concerns in it

# floor of each stage (the longest matching prefix wins); imports run down or level
FLOORS = {
    "phasewatch": 0,  # the package face (its __init__ imports nothing)
    "phasewatch.protocol": 0,  # generated protobuf code
    "phasewatch.requests": 1,  # the request record and its phases
    "phasewatch.catalog": 2,  # every published family: names, types, help, labels, buckets
    "phasewatch.options": 2,  # every option once (a table: the records' fields, the flags)
    "phasewatch.selfstats": 2,
    "phasewatch.transport": 3,  # listeners: gRPC plumbing, HTTP server, auth, TLS, admission
    "phasewatch.aggregation": 3,  # the sink contract, trace join, state and window
    "phasewatch.roofline": 4,
    "phasewatch.ingest": 4,  # receivers: wire protocol, OTLP, adapters, lifecycle join
    "phasewatch.publish": 5,
    "phasewatch.client": 5,
    "phasewatch.sim": 6,
    "phasewatch.tap": 6,
    "phasewatch.config": 6,
    "phasewatch.options_commands": 6,  # the other commands' options (name the simulator's)
    "phasewatch.flags": 6,  # flags from the option tables, variables read at parse time
    "phasewatch.dashboard": 7,
    "phasewatch.app": 8,  # the process: wires the stages
    "phasewatch.app_loops": 8,  # its background threads: sweeps, roofline, engine scrapes
    "phasewatch.cli": 9,
    "phasewatch.commands": 9,
}


def modules() -> dict[str, Path]:
    """Every module of the installed package, by its dotted name."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts or path.name.endswith("_pb2.py") \
                    or path.name.endswith("_pb2_grpc.py"):
                continue
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "phasewatch" and parts[:1] == ["dashboard"]:
                continue  # not a folder of exporter/
            found[name] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules ``path`` imports (``from a import b`` names module a.b when
    it is one, else a)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[:len(up) - node.level + 1]
                base = ".".join([*up, base]) if base else ".".join(up)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    edges = {}
    for name, path in mods.items():
        found = imports(path, name, known)
        # a package's __init__ reached through "from pkg import mod" is mod, not pkg
        edges[name] = {t for t in found if not (t in known and mods[t].name == "__init__.py"
                                                 and any(o.startswith(t + ".") for o in found))}
    return edges


def floor(name: str) -> int:
    best = max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len,
               default=None)
    assert best is not None, f"{name} is on no floor: give its stage one in FLOORS"
    return FLOORS[best]


def stage(name: str) -> str:
    return max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    found = circles(graph())
    assert not found, "modules that import each other:\n" + "\n".join(map(str, found))


def test_no_import_runs_back_up_a_floor():
    edges = graph()
    up = [f"{a} (floor {floor(a)}) -> {b} (floor {floor(b)})"
          for a, targets in sorted(edges.items()) for b in sorted(targets)
          if floor(b) > floor(a) and stage(a) != stage(b)]
    assert not up, "imports that run back up:\n" + "\n".join(up)


def test_no_module_in_the_exporter_over_about_400_lines():
    long = {str(p.relative_to(ROOT)): n for name, p in modules().items()
            if name.startswith("phasewatch.") and not name.startswith("phasewatch.dashboard")
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_every_module_is_on_a_floor():
    for name in modules():
        floor(name)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def test_the_otlp_ingest_names_no_engine():
    """What the OTLP ingest knows of an engine, the engine's adapter declares
    (``ingest.adapters.contract``): ``ingest/otlp/`` names none, so a new engine is one
    adapter module and one line in the registry (``ingest.adapters.ADAPTERS``). No
    identifier or string there holds a registered adapter's name or engine label, no
    string is a span name an adapter claims, and no comment or docstring names an engine
    (an adapter whose rows are the engine's side)."""
    from phasewatch.ingest.adapters import ADAPTERS

    names = {a.__name__.rpartition(".")[2] for a in ADAPTERS} | {a.ENGINE for a in ADAPTERS}
    span_names = set(ADAPTERS.extract)
    engines = {a.__name__.rpartition(".")[2] for a in ADAPTERS if a.CAPABILITIES.source is None}
    found = []
    for path in sorted((ROOT / "exporter" / "ingest" / "otlp").rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text, str(path))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef
                                    | ast.AsyncFunctionDef)
                      and n.body and isinstance(n.body[0], ast.Expr)
                      and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                idents = [node.id]
            elif isinstance(node, ast.Attribute):
                idents = [node.attr]
            elif isinstance(node, ast.alias):
                idents = [node.name, node.asname or ""]
            elif isinstance(node, ast.ImportFrom):
                idents = [node.module or ""]
            elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
                idents = [node.name]
            elif isinstance(node, ast.arg):
                idents = [node.arg]
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in docstrings):
                if node.value in span_names or _words(node.value) & names:
                    found.append(f"{path.name}:{node.lineno}: string {node.value!r}")
                continue
            else:
                continue
            for ident in idents:
                if set(re.split(r"[._]", ident.lower())) & names:
                    found.append(f"{path.name}:{node.lineno}: {ident}")
        for lineno, line in enumerate(text.splitlines(), 1):  # prose: comments, docstrings
            if _words(line) & engines:
                found.append(f"{path.name}:{lineno}: {line.strip()}")
    assert not found, ("the OTLP ingest names an engine (declare it on the adapter, "
                       "ingest.adapters.contract.Capabilities):\n" + "\n".join(found))


# The roofline's public functions take typed records, not dicts (issue 38). A ratchet:
# these still do, and the list only shrinks (a new one fails, a fixed one must leave it).
# None left: calibrate's figures by dtype are its measuring step's own (_cpu_half_floor,
# _half_precision_note), not a contract between modules.
DICT_PARAMS_LEFT: dict[str, str] = {}
# A document phasewatch does not define, parsed from JSON, is read as what it is: a
# read-only ``Mapping[str, Any]`` whose keys are another project's (a record of ours would
# only copy them). The modules that read one, and the document.
EXTERNAL_DOCUMENTS = {"hf_config": "a Hugging Face config.json"}


def test_no_dict_typed_parameters_in_the_roofline_public_functions():
    found = set()
    for p in sorted((FOLDERS["phasewatch"] / "roofline").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                    not node.name.startswith("_"):
                for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    text = ast.unparse(a.annotation) if a.annotation else ""
                    if p.stem in EXTERNAL_DOCUMENTS and text == "Mapping[str, Any]":
                        continue
                    kinds = {t.split("[")[0].strip().split(".")[-1] for t in text.split("|")}
                    if kinds & {"dict", "Mapping", "MutableMapping"}:
                        found.add(f"{p.stem}:{node.name}({a.arg})")
    left = {f"{m}:{f}" for m, fs in DICT_PARAMS_LEFT.items() for f in fs.split()}
    assert not found - left, f"new dict-typed parameters: {sorted(found - left)}"
    assert not left - found, f"no longer dict-typed, drop from the list: {sorted(left - found)}"


# The records whose fields come from an option table (``options.option_fields``), each
# with the table it takes them from: an option's default is written in the table alone
# (issue 38), so none of these writes one again as a field of its own.
def _records() -> dict[tuple[str, str], set[str]]:
    from phasewatch.options import MODEL_OPTIONS, SERVE_OPTIONS, TAP_OPTIONS

    return {("config.py", "ServeConfig"): {o.name for o in SERVE_OPTIONS},
            ("tap/config.py", "TapConfig"): {o.name for o in TAP_OPTIONS},
            ("roofline/deployments.py", "ModelOptions"): {o.name for o in MODEL_OPTIONS}}


def literal_option_fields(source: str, cls: str, names: set[str]) -> list[str] | None:
    """The fields of class ``cls`` in ``source`` named as an option of ``names`` whose
    default is a literal (``port: int = 8001``); None when there is no such class."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            found = []
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and item.value is not None:
                    targets = [item.target]
                elif isinstance(item, ast.Assign):
                    targets = item.targets
                else:
                    continue
                for t in targets:
                    if isinstance(t, ast.Name) and t.id in names:
                        try:
                            ast.literal_eval(item.value)
                        except ValueError:
                            continue
                        found.append(f"{cls}.{t.id} (line {item.lineno})")
            return found
    return None


def test_no_option_default_written_again_in_a_record():
    assert literal_option_fields("class C:\n    port: int = 8001\n    n = -1\n", "C",
                                 {"port", "n"}) == ["C.port (line 2)", "C.n (line 3)"]
    found = []
    for (path, cls), names in _records().items():
        fields = literal_option_fields((FOLDERS["phasewatch"] / path).read_text(), cls, names)
        assert fields is not None, f"{path} has no class {cls}: update _records"
        found += fields
    assert not found, ("an option's default written again (it is the table's: "
                       "options.option_fields gives the record its fields):\n"
                       + "\n".join(found))
