"""The operator files in ``deploy/``: Prometheus alerting rules and a Grafana dashboard, checked without a cluster.

* ``deploy/prometheus/specserve-alerts.yaml`` has the shape of a Prometheus rule file (groups with unique names,
  rules with exactly one of ``alert``/``record``, durations Prometheus reads, a known severity, a summary and a
  description), and the labels its annotations print are labels its expression keeps.
* ``deploy/grafana/specserve-dashboard.json`` is a dashboard Grafana imports: unique panel ids, a title, targets and a
  place on the grid for every panel, a Prometheus datasource variable, and every selector of every target filtered
  by the ``$model`` (and ``$lossy``) variables.
* Every PromQL expression of both files parses (``promql_parser``, Grafana's variables first replaced by values), and
  every metric it selects is one that :class:`~specserve.serve.metrics.ServeMetrics` declares, under the name Ray's
  Prometheus exporter gives it, with only that metric's own tag keys (or the labels Ray and Prometheus add) in its
  matchers and in the ``by``/``on`` clauses around it.
* ``deploy/README.md`` names every file under ``deploy/`` and explains every alert.

The metrics are taken from ``ServeMetrics`` itself, with Ray's metric classes replaced by recorders: a metric renamed
or a tag key dropped there fails here. Does not: run Prometheus or Grafana, evaluate any expression against data,
check label *values* (``result="mismatch"``) or thresholds, or check a recording rule's output labels.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "specserve-alerts.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "specserve-dashboard.json"
DEPLOY_README = ROOT / "deploy" / "README.md"

# Labels on every series that are not a metric's own tag keys: Ray's (per process and node) and Prometheus' scrape
# labels. ``le`` is a histogram bucket's own, allowed on ``_bucket`` series only.
RAY_LABELS = frozenset({"SessionName", "WorkerId", "Component", "NodeAddress", "instance", "job"})
BUCKET_LABEL = "le"
SEVERITIES = frozenset({"critical", "warning", "info"})
# Prometheus' duration syntax (units largest first, each at most once), e.g. 15m, 1h30m.
DURATION = re.compile(r"^(?=\d)(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m(?!s))?(\d+s)?(\d+ms)?$")
# Grafana's own variables, replaced by a plausible value before parsing.
GRAFANA_BUILTINS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
# $name, ${name}, ${name:format}, [[name]]
GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
# The dashboard variables every selector must be filtered by.
FILTER_VARIABLES = ("model", "lossy")
ALERT_TEMPLATE_LABEL = re.compile(r"\$labels\.(\w+)")


# ---------------------------------------------------------------------------------------------
# What the server exports, from ServeMetrics itself


@dataclass(frozen=True)
class Declared:
    kind: str  # Counter, Gauge, Histogram
    name: str
    tag_keys: tuple[str, ...]


class RecordingMetric:
    """What every recorder is: it accepts updates and exports nothing."""

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        pass

    set = observe = inc


def recorder(kind: str, real: type, into: list[Declared]) -> type[RecordingMetric]:
    """A stand-in for Ray's ``kind`` that binds its arguments with the real class's signature and records them."""
    signature = inspect.signature(real.__init__)

    class Recorder(RecordingMetric):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            into.append(Declared(kind, bound.arguments["name"], tuple(bound.arguments["tag_keys"] or ())))

    return Recorder


def declared_metrics(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Declared]]:
    """A ``ServeMetrics`` built with Ray's Counter, Gauge and Histogram replaced by recorders, and every metric it
    created."""
    import ray.util.metrics

    from specserve.serve.metrics import ServeMetrics

    found: list[Declared] = []
    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(ray.util.metrics, kind, recorder(kind, getattr(ray.util.metrics, kind), found))
    return ServeMetrics("m"), found


def exported_series(declared: list[Declared]) -> dict[str, frozenset[str]]:
    """Each series name Ray's Prometheus exporter gives these metrics, with the labels it may carry."""
    series: dict[str, frozenset[str]] = {}
    for metric in declared:
        name = f"ray_{metric.name}"
        labels = frozenset(metric.tag_keys) | RAY_LABELS
        if metric.kind == "Counter":
            names = {f"{name}_total": labels}
        elif metric.kind == "Gauge":
            names = {name: labels}
        elif metric.kind == "Histogram":
            names = {f"{name}_bucket": labels | {BUCKET_LABEL}, f"{name}_sum": labels, f"{name}_count": labels}
        else:
            raise AssertionError(f"unknown metric kind {metric.kind}")
        for exported, allowed in names.items():
            assert exported not in series, f"two metrics export {exported}"
            series[exported] = allowed
    return series


@pytest.fixture(scope="module")
def exported() -> dict[str, frozenset[str]]:
    with pytest.MonkeyPatch.context() as monkeypatch:  # Ray's classes are back once the metrics are built
        declared = declared_metrics(monkeypatch)[1]
    return exported_series(declared)


# ---------------------------------------------------------------------------------------------
# PromQL: the selectors of an expression, and what is wrong with them


@dataclass(frozen=True)
class Selector:
    """One series selector of an expression: its metric, its matchers, the grouping labels applied around it."""

    name: str | None
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)
    grouping: frozenset[str]  # labels of every enclosing by/without, on/ignoring and group_left/right clause


def children(node: Any) -> list[Any]:
    """A node's sub-expressions, found by inspecting its attributes (every node kind, without naming them)."""
    found = []
    for attribute in dir(node):
        if attribute.startswith("_"):
            continue
        value = getattr(node, attribute)
        if isinstance(value, promql_parser.Expr):
            found.append(value)
        elif isinstance(value, list):
            found.extend(item for item in value if isinstance(item, promql_parser.Expr))
    return found


def grouping_labels(node: Any) -> set[str]:
    """The labels a node's own modifier names: an aggregation's by/without, a binary operation's on/ignoring and
    group_left/group_right."""
    modifier = getattr(node, "modifier", None)
    if modifier is None:
        return set()
    labels = set(getattr(modifier, "labels", None) or ())
    matching = getattr(modifier, "matching", None)
    if matching is not None:
        labels |= set(matching.labels or ())
    labels |= set(getattr(modifier, "group_labels", None) or ())
    return labels


def selectors(expr: str) -> list[Selector]:
    """Every vector selector of ``expr`` (matrix selectors' and subqueries' included); raises if it does not parse."""
    found: list[Selector] = []

    def visit(node: Any, grouping: frozenset[str]) -> None:
        grouping = grouping | grouping_labels(node)
        if isinstance(node, promql_parser.VectorSelector):
            groups = [node.matchers.matchers, *node.matchers.or_matchers]
            matchers = tuple((m.name, str(m.op).rsplit(".", 1)[-1], m.value) for group in groups for m in group)
            found.append(Selector(node.name, matchers, grouping))
        for child in children(node):
            visit(child, grouping)

    visit(promql_parser.parse(expr), frozenset())
    return found


def problems(expr: str, exported: Mapping[str, frozenset[str]], recorded: frozenset[str] = frozenset()) -> list[str]:
    """What is wrong with ``expr``'s selectors: a metric the server does not export, a label that metric does not
    carry (in a matcher or in a by/on clause around it). ``recorded``: series of recording rules (labels unchecked)."""
    found = []
    for selector in selectors(expr):
        name = selector.name
        if name is None:  # {__name__="..."}
            names = [value for label, op, value in selector.matchers if label == "__name__" and op == "Equal"]
            name = names[0] if len(names) == 1 else None
        if name is None:
            found.append(f"a selector without one metric name: {selector}")
            continue
        if name in recorded:
            continue
        if name not in exported:
            found.append(f"{name} is not a series the server exports")
            continue
        labels = {label for label, _, _ in selector.matchers if label != "__name__"} | selector.grouping
        for label in sorted(labels - exported[name]):
            found.append(f"{name} has no label {label!r}")
    return found


def grafana_variables(text: str) -> set[str]:
    """The variables a Grafana string refers to (Grafana's own ``__`` ones included)."""
    return {next(group for group in match.groups() if group) for match in GRAFANA_VARIABLE.finditer(text)}


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """A Grafana target as Prometheus receives it: each variable replaced by ``values`` or a Grafana builtin's."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        return {**GRAFANA_BUILTINS, **values}[name]

    return GRAFANA_VARIABLE.sub(value, expr)


def sentinel(variable: str) -> str:
    """What a dashboard variable becomes in a parsed target: a label value that says where it came from."""
    return f"grafana_var_{variable}"


# ---------------------------------------------------------------------------------------------
# The files


def read_rules() -> dict[str, Any]:
    return yaml.safe_load(ALERTS.read_text())


def rules() -> list[dict[str, Any]]:
    return [rule for group in read_rules()["groups"] for rule in group["rules"]]


RULES = rules()


def read_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def template_variables(dashboard: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {variable["name"]: variable for variable in dashboard["templating"]["list"]}


def dashboard_targets(dashboard: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(panel["title"], target) for panel in dashboard["panels"] for target in panel.get("targets", [])]


TARGETS = dashboard_targets(read_dashboard())


def target_id(panel_target: tuple[str, dict[str, Any]]) -> str:
    return f"{panel_target[0]}/{panel_target[1]['refId']}"


def parsed_target(dashboard: Mapping[str, Any], expr: str) -> str:
    return substitute(expr, {name: sentinel(name) for name in template_variables(dashboard)})


# ---------------------------------------------------------------------------------------------
# The checker itself


def test_exported_series_follow_rays_naming(exported: dict[str, frozenset[str]]) -> None:
    assert "ray_specserve_requests_total" in exported  # a Counter: _total
    assert "ray_specserve_queue_length" in exported  # a Gauge: as declared
    assert {"ray_specserve_time_to_first_token_seconds_bucket", "ray_specserve_time_to_first_token_seconds_sum",
            "ray_specserve_time_to_first_token_seconds_count"} <= set(exported)  # fmt: skip
    assert "ray_specserve_requests" not in exported and "ray_specserve_queue_length_total" not in exported
    assert {"model", "lossy", "finish_reason", *RAY_LABELS} == exported["ray_specserve_requests_total"]
    assert BUCKET_LABEL in exported["ray_specserve_gamma_bucket"]
    assert BUCKET_LABEL not in exported["ray_specserve_gamma_sum"]
    assert all({"model", "lossy"} <= labels for labels in exported.values())


def test_every_metric_of_serve_metrics_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorders saw every metric attribute ServeMetrics holds (none created some other way)."""
    metrics, found = declared_metrics(monkeypatch)
    held = [value for value in vars(metrics).values() if isinstance(value, RecordingMetric)]
    assert len(held) == len(found) > 10
    assert len({metric.name for metric in found}) == len(found), "two metrics share a name"
    assert {metric.kind for metric in found} == {"Counter", "Gauge", "Histogram"}


def test_the_checker_accepts_good_promql(exported: dict[str, frozenset[str]]) -> None:
    good = (
        "histogram_quantile(0.99, sum by (model, le) (rate(ray_specserve_time_to_first_token_seconds_bucket"
        '{model="m", WorkerId!=""}[5m])))'
    )
    assert problems(good, exported) == []
    assert problems("sum by (model, drafter) (ray_specserve_speculation_speedup)", exported) == []


def test_the_checker_reports_a_metric_the_server_does_not_export(exported: dict[str, frozenset[str]]) -> None:
    found = problems('sum by (model) (rate(ray_specserve_nonexistent_total{model="m"}[5m]))', exported)
    assert found == ["ray_specserve_nonexistent_total is not a series the server exports"]
    # the declared name without Ray's suffix, and a Gauge given a Counter's suffix
    assert problems("ray_specserve_requests", exported) != []
    assert problems("ray_specserve_queue_length_total", exported) != []
    assert problems('{__name__=~"ray_specserve_.+"}', exported) != []
    assert problems('{__name__="ray_specserve_queue_length"}', exported) == []


def test_the_checker_reports_labels_a_metric_does_not_carry(exported: dict[str, frozenset[str]]) -> None:
    assert problems('ray_specserve_requests_total{drafter="x"}', exported) == [
        "ray_specserve_requests_total has no label 'drafter'"
    ]
    assert problems("sum by (model, drafter) (rate(ray_specserve_generated_tokens_total[5m]))", exported) != []
    assert problems("histogram_quantile(0.5, sum by (le) (rate(ray_specserve_gamma_sum[5m])))", exported) != []
    on_clause = "ray_specserve_queue_length / on (model, result) ray_specserve_running_requests"
    assert problems(on_clause, exported) != []


def test_unparsable_promql_raises() -> None:
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(ray_specserve_requests_total[5m])")
    with pytest.raises(ValueError):
        selectors("sum by (model) (ray_specserve_requests_total[5m])")  # a range vector where a vector goes


def test_the_duration_check_bites() -> None:
    assert all(DURATION.match(good) for good in ("15m", "1h30m", "500ms", "2d", "1h5s"))
    assert not any(DURATION.match(bad) for bad in ("15", "m", "", "30m1h", "1.5h", "15 m"))


def test_grafana_variables_are_substituted_before_parsing() -> None:
    expr = 'rate(x{model=~"$model", lossy=~"${lossy}"}[$__rate_interval])'
    assert grafana_variables(expr) == {"model", "lossy", "__rate_interval"}
    assert substitute(expr, {"model": "a", "lossy": "b"}) == 'rate(x{model=~"a", lossy=~"b"}[5m])'
    with pytest.raises(KeyError):
        substitute(expr, {"model": "a"})


# ---------------------------------------------------------------------------------------------
# deploy/prometheus/specserve-alerts.yaml


def test_rule_file_has_prometheus_shape() -> None:
    raw = read_rules()
    assert set(raw) == {"groups"}
    names = [group["name"] for group in raw["groups"]]
    assert names and len(names) == len(set(names)), f"group names must be unique: {names}"
    for group in raw["groups"]:
        assert set(group) <= {"name", "interval", "limit", "query_offset", "labels", "rules"}, group["name"]
        assert group["rules"], f"group {group['name']} has no rules"
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule
            assert ("alert" in rule) != ("record" in rule), f"exactly one of alert/record: {rule}"
            assert isinstance(rule.get("expr"), str) and rule["expr"].strip(), rule
            for key in ("for", "keep_firing_for"):
                if key in rule:
                    assert isinstance(rule[key], str) and DURATION.match(rule[key]), f"{key}: {rule[key]!r}"
                    promql_parser.parse_duration(rule[key])
            if "record" in rule:
                assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["record"]), rule["record"]
                assert not {"for", "annotations"} & set(rule), f"a recording rule: {rule['record']}"
                continue
            assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", rule["alert"]), rule["alert"]
            assert rule.get("labels", {}).get("severity") in SEVERITIES, f"{rule['alert']}: severity"
            annotations = rule.get("annotations", {})
            for key in ("summary", "description"):
                assert isinstance(annotations.get(key), str) and annotations[key].strip(), f"{rule['alert']}: {key}"


def test_alert_names_are_unique_and_the_expected_ones_are_there() -> None:
    names = [rule["alert"] for rule in rules() if "alert" in rule]
    assert len(names) == len(set(names)), f"duplicate alert names: {names}"
    assert {
        "SpecserveShadowMismatch",
        "SpecserveShadowNearTies",
        "SpecserveAcceptanceDrift",
        "SpecserveSpeculationNotPaying",
        "SpecserveShadowChecksStarved",
    } <= set(names)
    severity = {rule["alert"]: rule["labels"]["severity"] for rule in rules() if "alert" in rule}
    assert severity["SpecserveShadowMismatch"] == "critical"
    assert severity["SpecserveShadowChecksStarved"] == "info"


def test_the_mismatch_alert_tells_how_to_replay() -> None:
    mismatch = next(rule for rule in rules() if rule.get("alert") == "SpecserveShadowMismatch")
    assert "specserve replay" in mismatch["annotations"]["description"]
    assert 'result="mismatch"' in mismatch["expr"]
    assert "for" not in mismatch, "one mismatch is enough: the alert fires at once"


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.get("alert") or rule.get("record"))
def test_rule_expression_parses_and_selects_only_exported_series(
    rule: dict[str, Any], exported: dict[str, frozenset[str]]
) -> None:
    recorded = frozenset(r["record"] for r in rules() if "record" in r)
    assert problems(rule["expr"], exported, recorded) == []


@pytest.mark.parametrize("rule", [r for r in RULES if "alert" in r], ids=lambda rule: rule["alert"])
def test_alerts_aggregate_away_rays_per_process_labels(rule: dict[str, Any]) -> None:
    """Every selector sits inside a ``by (...)`` aggregation that keeps none of Ray's process labels, and the labels
    the annotations print are ones those clauses keep."""
    found = selectors(rule["expr"])
    assert found
    for selector in found:
        assert selector.grouping, f"{selector.name} is not aggregated: one alert per replica process"
        assert not selector.grouping & RAY_LABELS, f"{selector.name} keeps {selector.grouping & RAY_LABELS}"
    kept = set.union(*(set(selector.grouping) for selector in found))
    printed = set(ALERT_TEMPLATE_LABEL.findall(json.dumps(rule["annotations"])))
    assert printed <= kept, f"annotations print labels the expression drops: {printed - kept}"


# ---------------------------------------------------------------------------------------------
# deploy/grafana/specserve-dashboard.json


def test_dashboard_loads_with_unique_panels_on_the_grid() -> None:
    dashboard = read_dashboard()
    assert isinstance(dashboard.get("schemaVersion"), int) and dashboard["schemaVersion"] >= 36
    assert dashboard.get("title") and dashboard.get("uid")
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        assert isinstance(panel.get("title"), str) and panel["title"].strip(), f"panel {panel['id']} has no title"
        assert panel.get("type") in {"timeseries", "stat", "gauge", "bargauge", "table", "heatmap"}, panel["title"]
        assert panel.get("datasource", {}).get("uid") == "${DS_PROMETHEUS}", panel["title"]
        targets = panel.get("targets", [])
        assert targets, f"{panel['title']} has no target"
        refs = [target.get("refId") for target in targets]
        assert all(refs) and len(refs) == len(set(refs)), f"{panel['title']}: refIds {refs}"
        assert all(isinstance(target.get("expr"), str) and target["expr"].strip() for target in targets)
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid) and grid["x"] + grid["w"] <= 24, f"{panel['title']}: {grid}"
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_dashboard_has_a_prometheus_datasource_and_a_model_variable(exported: dict[str, frozenset[str]]) -> None:
    variables = template_variables(read_dashboard())
    datasource = variables["DS_PROMETHEUS"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    model = variables["model"]
    assert model["type"] == "query" and model["datasource"]["uid"] == "${DS_PROMETHEUS}"
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    match = re.fullmatch(r"label_values\((\w+),\s*model\)", query)
    assert match, f"the model variable's query: {query!r}"
    assert match[1] in exported and "model" in exported[match[1]]


def test_dashboard_variables_referenced_exist() -> None:
    dashboard = read_dashboard()
    defined = set(template_variables(dashboard))
    used = grafana_variables(DASHBOARD.read_text())
    assert not {name for name in used if not name.startswith("__")} - defined
    assert {name for name in used if name.startswith("__")} <= set(GRAFANA_BUILTINS)
    for variable in FILTER_VARIABLES:
        assert variable in defined


@pytest.mark.parametrize("panel_target", TARGETS, ids=target_id)
def test_dashboard_target_parses_and_selects_only_exported_series(
    panel_target: tuple[str, dict[str, Any]], exported: dict[str, frozenset[str]]
) -> None:
    _, target = panel_target
    expr = parsed_target(read_dashboard(), target["expr"])
    assert problems(expr, exported) == []


@pytest.mark.parametrize("panel_target", TARGETS, ids=target_id)
def test_dashboard_target_is_filtered_by_the_model_variable(panel_target: tuple[str, dict[str, Any]]) -> None:
    """Every selector of the target matches ``model`` (and ``lossy``) against the dashboard's variable."""
    title, target = panel_target
    found = selectors(parsed_target(read_dashboard(), target["expr"]))
    assert found, f"{title}: a target that selects nothing"
    for selector in found:
        for variable in FILTER_VARIABLES:
            matched = [(op, value) for label, op, value in selector.matchers if label == variable]
            assert matched in ([("Re", sentinel(variable))], [("Equal", sentinel(variable))]), (
                f'{title}: {selector.name} is not filtered by {variable}=~"${variable}"'
            )


def test_the_filter_check_bites() -> None:
    dashboard = read_dashboard()
    unfiltered = selectors(parsed_target(dashboard, 'sum(ray_specserve_queue_length{lossy=~"$lossy"})'))
    assert not any(label == "model" for label, _, _ in unfiltered[0].matchers)
    fixed = selectors(parsed_target(dashboard, 'ray_specserve_queue_length{model="$model", lossy=~"$lossy"}'))
    assert ("model", "Equal", sentinel("model")) in fixed[0].matchers


# ---------------------------------------------------------------------------------------------
# deploy/README.md


def test_deploy_readme_names_every_file_under_deploy() -> None:
    readme = DEPLOY_README.read_text()
    for path in sorted((ROOT / "deploy").rglob("*")):
        if path.is_file() and path != DEPLOY_README:
            relative = path.relative_to(ROOT / "deploy").as_posix()
            assert f"`{relative}`" in readme, f"deploy/README.md does not mention `{relative}`"
    for rule in rules():
        if "alert" in rule:
            assert rule["alert"] in readme, f"deploy/README.md does not explain {rule['alert']}"
