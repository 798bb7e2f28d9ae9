"""What an entry of the metric catalogue (``ddpmon.metrics``) is: a name with its type, help,
unit, extra labels and the layer of training it watches. Consumers import these names from
``ddpmon.metrics``, beside the entries."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["BASE_LABELS", "Layer", "Metric", "MetricType"]


class Layer(StrEnum):
    """Where a failure shows first; the order is the order of columns, rows and alert groups."""

    NUMERICS = "numerics"
    DATA_SUPPLY = "data supply"
    MEMORY = "memory"
    COMMUNICATION = "communication"
    IDENTITY = "identity / health"
    """Not a layer of training: identity info series and the agent's own health."""

    @property
    def slug(self) -> str:
        """Identifier form (``data_supply``) for rule-group names, file names, JSON keys."""
        return _SLUGS[self]


_SLUGS = {
    Layer.NUMERICS: "numerics",
    Layer.DATA_SUPPLY: "data_supply",
    Layer.MEMORY: "memory",
    Layer.COMMUNICATION: "communication",
    Layer.IDENTITY: "identity",
}


class MetricType(StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


BASE_LABELS = ("run", "rank")


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    type: MetricType
    help: str
    layer: Layer
    unit: str = ""
    """Base unit the name ends with (``seconds``, ``bytes``, ``ratio``); empty when unitless."""
    labels: tuple[str, ...] = ()
    """Labels beyond ``run`` and ``rank``; each has a bounded set of values."""
    when: str = "always"
    """When the series is present, for readers and the README."""
    base_labels: tuple[str, ...] = BASE_LABELS
    """The labels every series of its exporter carries: a rank's ``run`` and ``rank``; none for
    the node daemon's own series (one per node)."""

    @property
    def all_labels(self) -> tuple[str, ...]:
        return (*self.base_labels, *self.labels)

    @property
    def family(self) -> str:
        """The name prometheus_client's families take: counters without ``_total``."""
        return self.name.removesuffix("_total") if self.type is MetricType.COUNTER else self.name

    def sample(self, suffix: str) -> str:
        """A histogram's sample name: ``STEP_DURATION.sample("count")``."""
        return f"{self.name}_{suffix}"
