"""Memory metrics: names (one source of truth), probes, the recorder that logs them, TensorBoard layout."""

from lightmem.metrics.names import GROUPS, METRICS, Metric

__all__ = ["GROUPS", "METRICS", "Metric"]
