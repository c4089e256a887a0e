"""Counting what compression saves: bytes handed to the communicator vs. uncompressed bytes."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Traffic", "WireStats"]


@dataclass
class Traffic:
    """Bytes of one or more compressed reductions.

    Attributes:
        sent: bytes this rank handed to collectives (payloads and their metadata).
        raw: bytes of the same tensors uncompressed.
        calls: number of reductions counted.
    """

    sent: int = 0
    raw: int = 0
    calls: int = 0

    @property
    def ratio(self) -> float:
        """Compression ratio ``raw / sent`` (1.0 when nothing was counted, inf when nothing was sent)."""
        if self.sent == 0:
            return 1.0 if self.raw == 0 else float("inf")
        return self.raw / self.sent

    def add(self, sent: int, raw: int) -> None:
        """Count one more reduction."""
        self.sent += int(sent)
        self.raw += int(raw)
        self.calls += 1


@dataclass
class WireStats:
    """Traffic per call, per step, per tensor name and in total, on this rank.

    A data-parallel optimizer closes a step (:meth:`end_step`) at every optimizer
    step, so ``steps`` holds the bytes of each step.

    ``sent`` counts the payload bytes this rank contributes to each collective
    (an allgather's input, not its output), so it measures what compression
    saves, not what a particular allreduce algorithm moves. Horovod 0.28's CPU
    ops carry bfloat16 as float32; the count is still 2 bytes per element.

    Attributes:
        total: every call since creation (or :meth:`reset`).
        current: calls since the last :meth:`end_step`.
        last_call: the most recent call.
        steps: closed steps, oldest first (the last ``keep_steps``).
        by_name: totals per tensor name.
        keep_steps: how many closed steps to keep.
    """

    total: Traffic = field(default_factory=Traffic)
    current: Traffic = field(default_factory=Traffic)
    last_call: Traffic = field(default_factory=Traffic)
    steps: list[Traffic] = field(default_factory=list)
    by_name: dict[str, Traffic] = field(default_factory=dict)
    keep_steps: int = 1000

    def record(self, name: str, sent: int, raw: int) -> None:
        """Count one compressed reduction of tensor ``name``.

        Args:
            name: the tensor's name.
            sent: bytes handed to collectives.
            raw: bytes of the tensor uncompressed.
        """
        self.total.add(sent, raw)
        self.current.add(sent, raw)
        self.last_call = Traffic(int(sent), int(raw), 1)
        self.by_name.setdefault(name, Traffic()).add(sent, raw)

    def end_step(self) -> Traffic:
        """Close the current step and start a new one.

        Returns:
            The traffic of the step just closed.
        """
        done, self.current = self.current, Traffic()
        self.steps.append(done)
        del self.steps[: max(0, len(self.steps) - self.keep_steps)]
        return done

    @property
    def ratio(self) -> float:
        """Achieved compression ratio over everything counted."""
        return self.total.ratio

    @property
    def last_step(self) -> Traffic:
        """The traffic of the most recently closed step (empty before the first)."""
        return self.steps[-1] if self.steps else Traffic()

    def summary(self) -> dict[str, float]:
        """A JSON-friendly summary: totals, closed steps, the last step and the ratio."""
        last = self.last_step
        return {"sent": self.total.sent, "raw": self.total.raw, "calls": self.total.calls,
                "steps": len(self.steps), "last_step_sent": last.sent, "last_step_raw": last.raw,
                "ratio": self.ratio}

    def reset(self) -> None:
        """Forget everything counted."""
        self.total, self.current, self.last_call = Traffic(), Traffic(), Traffic()
        self.steps.clear()
        self.by_name.clear()
