"""Small builders over grafana-foundation-sdk for the panels Tandem's dashboards repeat.

Every panel reads the dashboard's ``datasource`` variable. Threshold colours come from
``deploy/grafana/slo.py``; a target that is a dashboard variable is drawn as a dashed red series
named "target" instead, so that it follows the variable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_m

DATASOURCE = dashboard_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
MODEL = 'model_name=~"$model_name"'  # the label filter of every query
TENANT = 'tenant=~"$tenant"'  # and of every query over a series per tenant (TENANT_SCOPED)
# The gateway's per-request series, labelled with the tenant whose API key sent the request
# (services/gateway/metrics.py).
TENANT_SCOPED = frozenset({
    "tandem_request_success_total", "tandem_request_failures_total",
    "tandem_request_within_slo_total", "tandem_prompt_tokens_total",
    "tandem_generation_tokens_total",
    *(f"tandem_{name}_seconds_{part}" for name in (
        "time_to_first_token", "inter_token_latency", "request_time_per_output_token",
        "e2e_request_latency") for part in ("bucket", "count", "sum"))})

GREEN, RED = "green", "red"
TARGET = "target"  # legend (and override name) of a target line


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


def target_line(variable: str) -> Query:
    """A dashboard variable drawn as a horizontal series."""
    return Query(f"vector(${variable})", TARGET)


def _targets(queries: Sequence[Query]) -> list[prometheus.Dataquery]:
    return [prometheus.Dataquery().expr(q.expr).legend_format(q.legend or "__auto")
            .ref_id(chr(ord("A") + i)).range() for i, q in enumerate(queries)]


def thresholds(*steps: tuple[float, str], base: str = GREEN) -> dashboard_b.ThresholdsConfig:
    """Colour steps above a base colour. The base step's value is a placeholder: Grafana reads
    the first step as -Infinity (and the schema wants a number there, not JSON's null)."""
    return (dashboard_b.ThresholdsConfig().mode(dashboard_m.ThresholdsMode.ABSOLUTE)
            .steps([dashboard_m.Threshold(value=0.0, color=base),
                    *(dashboard_m.Threshold(value=v, color=c) for v, c in steps)]))


def time_series(title: str, description: str, queries: Sequence[Query], unit: str, *,
                width: int = 8, stacked: bool = False,
                steps: Sequence[tuple[float, str]] = (), base: str = GREEN,
                soft_max: float | None = None) -> timeseries.Panel:
    """A time series; ``steps`` are drawn as dashed threshold lines."""
    panel = (timeseries.Panel().title(title).description(description).datasource(DATASOURCE)
             .targets(_targets(queries)).unit(unit).span(width).height(8)
             .legend(common_b.VizLegendOptions().show_legend(True)
                     .display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).calcs([]))
             .tooltip(common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING))
             .line_width(1).fill_opacity(10 if stacked else 0).axis_soft_min(0))
    if soft_max is not None:
        panel = panel.axis_soft_max(soft_max)
    if stacked:
        panel = panel.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    if steps:
        panel = (panel.thresholds(thresholds(*steps, base=base))
                 .thresholds_style(common_b.GraphThresholdsStyleConfig()
                                   .mode(common.GraphThresholdsStyleMode.DASHED)))
    if any(q.legend == TARGET for q in queries):
        # byNames, not byName: its options are an object, as the dashboard schema requires.
        names = dashboard_m.MatcherConfig(id_val="byNames",
                                          options={"mode": "include", "names": [TARGET]})
        panel = panel.with_override(names, [
            dashboard_m.DynamicConfigValue(id_val="color",
                                           value={"mode": "fixed", "fixedColor": RED}),
            dashboard_m.DynamicConfigValue(id_val="custom.lineStyle",
                                           value={"fill": "dash", "dash": [10, 10]}),
            dashboard_m.DynamicConfigValue(id_val="custom.stacking", value={"mode": "none"}),
        ])
    return panel


def single_stat(title: str, description: str, query: Query, unit: str, *,
                steps: Sequence[tuple[float, str]] = (), base: str = GREEN,
                width: int = 4) -> stat.Panel:
    """The latest value of one query, coloured by ``steps``."""
    return (stat.Panel().title(title).description(description).datasource(DATASOURCE)
            .targets(_targets([query])).unit(unit).span(width).height(4)
            .thresholds(thresholds(*steps, base=base))
            .color_mode(common.BigValueColorMode.BACKGROUND)
            .graph_mode(common.BigValueGraphMode.AREA)
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))


def label(name: str, value: str, op: str = "=") -> str:
    """One label matcher: ``name="value"``."""
    return f'{name}{op}"{value}"'


def rate(metric: str, selector: str = "", window: str = "$__rate_interval") -> str:
    """``rate(metric{model filter, tenant filter if per tenant, selector}[window])``."""
    tenant = TENANT if metric in TENANT_SCOPED else ""
    labels = ", ".join(s for s in (MODEL, tenant, selector) if s)
    return f"rate({metric}{{{labels}}}[{window}])"


def quantile(q: float, bucket_rate: str, by: str = "") -> str:
    """``histogram_quantile`` over a summed bucket rate."""
    return f"histogram_quantile({q}, sum by (le{', ' + by if by else ''}) ({bucket_rate}))"
