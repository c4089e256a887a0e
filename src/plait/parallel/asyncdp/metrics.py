"""Per-rank metrics of asynchronous data parallelism."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AsyncMetrics"]


@dataclass
class AsyncMetrics:
    """What one rank did: steps, staleness of each applied update, time spent waiting.

    Attributes:
        rank: this rank in the data-parallel communicator.
        role: "worker" or "server".
        algorithm: the algorithm's name.
        steps: training steps this rank completed (servers: updates applied).
        staleness: for each update applied on this rank, how many steps (or, on a
            parameter server, versions) older than the current one it was.
        wait_seconds: time blocked waiting for other ranks.
        blocked_steps: steps that had to wait for a slower rank (SSP, bounded servers).
        messages: point-to-point messages or collectives this rank started.
    """

    rank: int
    role: str
    algorithm: str
    steps: int = 0
    staleness: list[int] = field(default_factory=list)
    wait_seconds: float = 0.0
    blocked_steps: int = 0
    messages: int = 0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the time spent inside the ``with`` block as waiting."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_seconds += time.perf_counter() - start

    @property
    def max_staleness(self) -> int:
        """Largest staleness of an applied update (0 when none)."""
        return max(self.staleness, default=0)

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly summary (staleness as max and mean)."""
        mean = sum(self.staleness) / len(self.staleness) if self.staleness else 0.0
        return {"rank": self.rank, "role": self.role, "algorithm": self.algorithm,
                "steps": self.steps, "updates": len(self.staleness),
                "max_staleness": self.max_staleness, "mean_staleness": mean,
                "wait_seconds": self.wait_seconds, "blocked_steps": self.blocked_steps,
                "messages": self.messages}
