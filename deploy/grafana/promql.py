"""Which metrics a PromQL expression reads, and which series a /metrics page offers.

Enough of PromQL's lexical rules to find the metric names in the expressions Tandem's dashboards
and rules use: strings, label matchers ``{...}``, range and subquery brackets ``[...]``, Grafana
variables (``$x``, ``${x}``, ``[[x]]``), grouping label lists (``by (...)``, ``on (...)`` ...),
function calls, keywords and numbers are skipped; every other identifier is a metric name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<variable>\$\{[^}]*\}|\$\w+|\[\[\w+\]\])
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[a-zA-Z]*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<punct>=~|!~|!=|==|>=|<=|[-+*/%^(){}\[\],=<>@])
""", re.VERBOSE)

# Identifiers that are part of the language, not metrics. Aggregations are among them: their
# grouping clause may come before the parenthesis (``sum by (le) (...)``).
KEYWORDS = frozenset({
    "and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left",
    "group_right", "offset", "inf", "nan", "start", "end",
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile", "limitk", "limit_ratio",
})
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


class PromQLSyntaxError(ValueError):
    pass


def tokens(expr: str) -> list[tuple[str, str]]:
    """(kind, text) pairs, whitespace dropped."""
    out, pos = [], 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise PromQLSyntaxError(f"unexpected {expr[pos:pos + 20]!r} in {expr!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            out.append((kind, match.group()))
        pos = match.end()
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (``foo_bucket``, not the family ``foo``)."""
    toks = tokens(expr)
    names: set[str] = set()
    depth = {"{": 0, "[": 0, "(": 0}
    closing = {"}": "{", "]": "[", ")": "("}
    grouping = False  # the next "(" opens a label list
    label_list = 0  # >0 inside a grouping label list
    for i, (kind, text) in enumerate(toks):
        if kind == "punct":
            if text in depth:
                depth[text] += 1
            elif text in closing:
                depth[closing[text]] -= 1
                if depth[closing[text]] < 0:
                    raise PromQLSyntaxError(f"unbalanced {text!r} in {expr!r}")
            if text == "(" and grouping:
                label_list, grouping = 1, False
            elif text == "(" and label_list:
                label_list += 1
            elif text == ")" and label_list:
                label_list -= 1
            continue
        if text == "__name__":
            raise PromQLSyntaxError(f"select metrics by name, not by __name__: {expr!r}")
        if kind != "ident" or depth["{"] or depth["["] or label_list:
            continue
        if text in GROUPING:
            grouping = True
            continue
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if nxt == "(" or text.lower() in KEYWORDS:
            continue  # a function call or a keyword
        names.add(text)
    if any(depth.values()) or label_list:
        raise PromQLSyntaxError(f"unbalanced brackets in {expr!r}")
    return names


_TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)\s*$")

# The series a family of each type offers, by the name on its TYPE line.
_SUFFIXES = {
    "gauge": ("",),
    "untyped": ("",),
    "unknown": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
    "stateset": ("",),
}


def exported_families(exposition: str) -> dict[str, str]:
    """{family name: type} of every ``# TYPE`` line of a /metrics page."""
    families = {}
    for line in exposition.splitlines():
        match = _TYPE_LINE.match(line)
        if match:
            families[match.group(1)] = match.group(2)
    return families


def exported_series(exposition: str) -> set[str]:
    """Every metric name a query can select on a /metrics page, including the series of a family
    that has no samples yet (a counter no event has touched still has its TYPE line)."""
    names = set()
    for family, kind in exported_families(exposition).items():
        if kind == "counter":  # OpenMetrics names the family without _total, Prometheus' text
            names.add(family if family.endswith("_total") else family + "_total")  # with it
        else:
            names.update(family + suffix for suffix in _SUFFIXES.get(kind, ("",)))
    return names


_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<selector>.*),)?\s*\w+\s*\)\s*$", re.DOTALL)
_QUERY_RESULT = re.compile(r"^\s*query_result\((?P<expr>.*)\)\s*$", re.DOTALL)


def variable_query_metrics(query: str) -> set[str]:
    """The metrics a Grafana Prometheus variable query reads: ``label_values(selector, label)``,
    ``label_values(label)`` or ``query_result(expr)``."""
    if match := _LABEL_VALUES.match(query):
        return metric_names(match.group("selector")) if match.group("selector") else set()
    if match := _QUERY_RESULT.match(query):
        return metric_names(match.group("expr"))
    raise PromQLSyntaxError(f"unsupported variable query {query!r}")


def missing_metrics(exprs: Iterable[str], exposition: str) -> dict[str, set[str]]:
    """{metric name: the expressions that read it} for names the page does not offer."""
    offered = exported_series(exposition)
    missing: dict[str, set[str]] = {}
    for expr in exprs:
        for name in metric_names(expr) - offered:
            missing.setdefault(name, set()).add(expr)
    return missing


# Grafana's built-in variables, as a concrete query would read them.
BUILTIN_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h",
                     "__range_s": "3600", "__all": ".*"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with its Grafana variables replaced; an unknown variable raises KeyError."""
    known = {**BUILTIN_VARIABLES, **values}

    def value(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        if name not in known:
            raise KeyError(f"unknown dashboard variable ${name} in {expr!r}")
        return known[name]

    return _VARIABLE.sub(value, expr)
