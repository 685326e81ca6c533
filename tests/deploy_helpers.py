"""Helpers for the deploy/ tests: the Grafana dashboards' PromQL, metric names in it, compose
interpolation, and the Prometheus binaries (`make test` provides them, see
deploy/prometheus/install-prometheus.sh)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
TOOLS_BIN = REPO / ".tools" / "prometheus" / "usr" / "bin"

# words of PromQL that look like metric names but are not
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                   "and", "or", "unless", "offset", "inf", "nan"}


def prometheus_tool(name: str) -> str:
    """Path of `prometheus` or `promtool`: $PATH, else .tools/ (where `make test` unpacks
    Debian's package). Missing: the test fails, it does not skip."""
    found = shutil.which(name) or (str(TOOLS_BIN / name) if (TOOLS_BIN / name).exists() else None)
    if found is None:
        pytest.fail(f"{name} not found on PATH nor in {TOOLS_BIN}: run `make prometheus` "
                    "(Debian's prometheus package, unpacked into .tools/) or install your "
                    "system's prometheus package", pytrace=False)
    return found


def dashboards() -> dict[str, dict]:
    """Dashboard JSON models by file name."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(board: dict) -> Iterator[dict]:
    """Every panel, rows' nested panels included, rows themselves excluded."""
    for panel in board.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def panel_queries(board: dict) -> Iterator[tuple[dict, dict]]:
    """(panel, target) for every PromQL target of every panel."""
    for panel in panels(board):
        for target in panel.get("targets", []):
            yield panel, target


def variable_queries(board: dict) -> list[str]:
    out = []
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            out.append(query.get("query", "") if isinstance(query, dict) else str(query))
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords, labels and Grafana
    variables stripped). A Grafana label_values(metric, label) query gives its metric."""
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?\s*,"
                     r"\s*\w+\s*\)\s*", expr)
    if m:
        return {m.group(1)}
    s = re.sub(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'", '""', expr)     # strings
    s = re.sub(r"\{[^}]*\}", " ", s)                                         # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                                        # range windows
    s = re.sub(r"\boffset\s+\S+", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)                                       # Grafana variables
    s = re.sub(r"(?<![\w:])\d+(\.\d*)?([eE][+-]?\d+)?", " ", s)             # numbers
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("("):     # a function or an aggregation
            continue
        if m.group(0).lower() in PROMQL_KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def rated_metric_names(expr: str) -> set[str]:
    """Names that appear as the argument of rate() / irate() / increase()."""
    return set(re.findall(r"\b(?:rate|irate|increase)\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", expr))


def dashboard_metric_names() -> dict[str, set[str]]:
    """Metric name -> the panels (dashboard: panel title) that use it."""
    used: dict[str, set[str]] = {}
    for name, board in dashboards().items():
        for panel, target in panel_queries(board):
            for metric in metric_names(target.get("expr", "")):
                used.setdefault(metric, set()).add(f"{board['title']}: {panel['title']}")
        for query in variable_queries(board):
            for metric in metric_names(query):
                used.setdefault(metric, set()).add(f"{board['title']}: variables")
    return used


def interpolate(value, env: dict[str, str] | None = None):
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default} with `env` (default: empty, as
    on a machine where none of the variables is set), through lists and dicts."""
    env = {} if env is None else env
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return re.sub(r"\$\{(\w+)(?:(:-|-)([^}]*))?\}", sub, value)

