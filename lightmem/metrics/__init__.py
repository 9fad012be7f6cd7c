"""Memory metrics: names (one source of truth), probes, TensorBoard layout."""

from lightmem.metrics.names import GROUPS, METRICS, Metric

__all__ = ["GROUPS", "METRICS", "Metric"]
