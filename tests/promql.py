"""The metric names a PromQL expression reads, and those a Prometheus exposition exports.

Enough PromQL to name the series an alert rule selects: a tokenizer (strings, range and subquery
brackets, durations, numbers, identifiers, punctuation; anything else is an error, so an expression this cannot read fails a test
instead of yielding no names) and one rule over its tokens. An identifier is a metric name unless
it is followed by `(` (a function or an aggregation: `rate(`, `sum(`), is a keyword (`by`, `and`,
`offset`, an aggregation written `sum by (...) (...)`, ...), or stands inside `{...}` (label
matchers; `__name__="x"` there names metric `x`) or in the label list of `by`, `without`, `on`,
`ignoring`, `group_left` and `group_right`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+)(?![\w:.])
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?![\w:])
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>=~|!~|!=|==|>=|<=|[-+*/%^=<>(){},@])
    """,
    re.VERBOSE,
)

AGGREGATIONS = frozenset({
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
})  # fmt: skip
GROUPINGS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = AGGREGATIONS | GROUPINGS | {"and", "or", "unless", "offset", "bool", "atan2", "inf", "nan"}


class Token(NamedTuple):
    kind: str
    text: str


def tokens(expr: str) -> list[Token]:
    """The tokens of `expr`, without spaces and comments; ValueError at a character PromQL lacks."""
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read PromQL at {expr[pos : pos + 20]!r} in {expr!r}")
        kind = m.lastgroup or ""
        if kind not in ("space", "comment"):
            out.append(Token(kind, m.group()))
        pos = m.end()
    return out


def metric_names(expr: str) -> set[str]:
    """Every metric name `expr` selects."""
    toks, names, i = tokens(expr), set(), 0
    while i < len(toks):
        tok = toks[i]
        following = toks[i + 1].text if i + 1 < len(toks) else ""
        if tok.text == "{":
            i, named = _matchers(toks, i)
            names |= named
            continue
        if tok.kind == "ident" and tok.text.lower() in GROUPINGS and following == "(":
            i = _closing(toks, i + 1)
        elif tok.kind == "ident" and following != "(" and tok.text.lower() not in KEYWORDS:
            names.add(tok.text)
        i += 1
    return names


def _closing(toks: list[Token], i: int) -> int:
    """The index of the `)` closing the `(` at `i` (a label list holds no parentheses)."""
    end = next((j for j in range(i, len(toks)) if toks[j].text == ")"), None)
    if end is None:
        raise ValueError("unclosed label list")
    return end


def _matchers(toks: list[Token], i: int) -> tuple[int, set[str]]:
    """Skip the label matchers opened at `i`; returns the index after `}` and the metric names
    they give (`__name__="x"`, or a bare quoted name as PromQL 3 writes `{"x"}`)."""
    named: set[str] = set()
    j = i + 1
    while j < len(toks) and toks[j].text != "}":
        before, t, after = toks[j - 1].text, toks[j], [a.text for a in toks[j + 1 : j + 3]]
        if t.text == "__name__" and len(after) == 2 and after[0] == "=" and toks[j + 2].kind == "string":
            named.add(toks[j + 2].text[1:-1])
            j += 2
        elif t.kind == "string" and before in ("{", ",") and after[:1] in (["}"], [","]):
            named.add(t.text[1:-1])
        j += 1
    if j == len(toks):
        raise ValueError("unclosed label matchers")
    return j + 1, named


def exported_names(exposition: str) -> set[str]:
    """The sample names of a Prometheus text exposition (`/metrics`): a histogram's `_bucket`,
    `_count` and `_sum` each, a counter's `_total`."""
    return {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in exposition.splitlines()
        if line.strip() and not line.startswith("#")
    }


class Rule(NamedTuple):
    alert: str
    expr: str


def alert_rules(path: Path) -> list[Rule]:
    """The alerting rules of a Prometheus rules file (`groups: - rules: - alert: ... expr: ...`)."""
    import yaml

    doc: Any = yaml.safe_load(path.read_text())
    return [Rule(r["alert"], str(r["expr"])) for g in doc["groups"] for r in g["rules"] if "alert" in r]


def promql_blocks(markdown: str) -> list[str]:
    """The PromQL of every ```promql fenced block of a Markdown text, one expression per line."""
    blocks = re.findall(r"^```promql\n(.*?)^```", markdown, re.MULTILINE | re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def unexported(exprs: dict[str, str], exported: set[str]) -> dict[str, list[str]]:
    """{label: the metric names its expression reads that `exported` lacks}, for those lacking any;
    an expression that reads no metric at all is reported too (as `<none>`)."""
    out = {}
    for label, expr in exprs.items():
        names = metric_names(expr)
        missing = sorted(names - exported) if names else ["<none>"]
        if missing:
            out[label] = missing
    return out


def iter_exprs(rules_file: Path, guide: Path) -> Iterator[tuple[str, str]]:
    """(label, expression) of every alert in `rules_file` and every ```promql line of `guide`."""
    for rule in alert_rules(rules_file):
        yield rule.alert, rule.expr
    for n, expr in enumerate(promql_blocks(guide.read_text())):
        yield f"{guide.name} promql #{n + 1}", expr
