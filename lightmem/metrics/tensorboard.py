"""Ready-made TensorBoard panels (the Custom Scalars tab), built from the metric definitions."""

from __future__ import annotations

from collections.abc import Iterable

from lightmem.metrics.names import METRICS

CATEGORY = "lightmem memory"


def custom_scalars_layout(keys: Iterable[str]) -> dict[str, dict[str, list]]:
    """``{category: {chart title: ["Multiline", [tags]]}}`` for ``SummaryWriter.add_custom_scalars``.

    Only the metrics in ``keys`` (those really logged) are drawn: no chart for a feature that is off.
    """
    logged = set(keys)
    charts: dict[str, list[str]] = {}
    for metric in METRICS:
        if metric.key in logged:
            charts.setdefault(metric.panel, []).append(metric.key)
    return {CATEGORY: {title: ["Multiline", tags] for title, tags in charts.items()}}
