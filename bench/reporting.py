"""Helpers shared by the benchmark reports: target checks and the machine line."""

from __future__ import annotations

import math
import platform
from collections.abc import Mapping
from pathlib import Path


def meets_target(targets: Mapping[str, tuple[str, float]], name: str, value: float) -> bool:
    """Whether ``value`` meets ``targets[name]`` = (">=" or "<=", target); NaN never does."""
    comparison, target = targets[name]
    return math.isfinite(value) and (value >= target if comparison == ">=" else value <= target)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
