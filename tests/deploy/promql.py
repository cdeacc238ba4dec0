"""PromQL as the deployment files hold it: the Grafana dashboard's expressions, the README's
hit-rate query, and the metric names an expression reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "spyre-server.json"

# Grafana's variables, as a test substitutes them to run an expression on a plain Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": ".+", "$model_name": ".+"}

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_KEYWORDS |= {"and", "or", "unless", "inf", "nan"}


def dashboard_expressions(path: Path = DASHBOARD) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and variable queries."""
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def readme_hit_rate_query() -> str:
    """The README's hit-rate PromQL (its ```promql block)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```promql\n(.*?)```", readme, flags=re.DOTALL)
    assert len(blocks) == 1, "the README should hold exactly one promql block"
    return blocks[0].strip()


def substitute_grafana_variables(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def split_label_values(expr: str) -> tuple[str, str | None]:
    """Grafana's ``label_values(selector, label)`` -> ``(selector, label)``; other expressions
    -> ``(expr, None)``. Prometheus itself has no label_values."""
    match = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*", expr)
    return (match.group(1), match.group(2)) if match else (expr, None)


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects (Grafana's ``label_values(metric, label)`` included)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\blabel_values\(\s*([^,()]+?)\s*,[^)]*\)", r"\1", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if match.group(0).lower() in _KEYWORDS:
            continue
        names.add(match.group(0))
    return names
