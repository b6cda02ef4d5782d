"""Per-scenario threshold checks: thresholds are data (`kl_max: 0.05`), directions come from the metric table."""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.records import METRIC_DIRECTIONS


@dataclass(frozen=True, slots=True)
class ThresholdCheck:
    metric: str
    limit: float
    source: str  # the scenario file the threshold came from

    def __post_init__(self):
        if self.metric not in METRIC_DIRECTIONS:
            raise ValueError(f"{self.source}: threshold on unknown metric {self.metric!r}")

    def compute(self, turn: int, value: float | None) -> str | None:
        """None when the value passes; otherwise the failure message."""
        if value is None:
            return None
        lower_is_better = METRIC_DIRECTIONS[self.metric] == "lower"
        failed = math.isnan(value) or (value > self.limit if lower_is_better else value < self.limit)
        if not failed:
            return None
        sign = ">" if lower_is_better else "<"
        return f"turn {turn}: {self.metric} {value:.4g} {sign} {self.limit:g} (threshold from {self.source})"
