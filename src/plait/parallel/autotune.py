"""Fusion bucket size tuned in the first training steps (on by default for PyTorch).

A :class:`BucketTuner` tries each candidate bucket size for a few steps, timing
whole steps (from one :meth:`GradientReducer.finish` to the next, so forward,
backward and the overlap of communication with it all count), skipping the first
two steps after each change: the first checks the new buckets across ranks, the
second is the first on the unchecked copy of the communicator, and each fills
buffers of the new sizes for the first time (measured, 2 ranks, a 4.8M-parameter
MLP: 90 and 79 ms after a change to 16 MiB, then 30 and 22 ms as at 1 MiB; timing
from the second step on made 16 MiB look 2x slower than it is). Then every
rank contributes its per-candidate medians to one small allreduce (``max``: exact,
so every rank gets the same numbers) and all pick the same fastest size. Only
uncompressed gradients are tuned: a lossy compressor's result (and its
error-feedback memory, kept per bucket) depends on the grouping. The
choice is printed by rank 0 and recorded in the timeline (``PLAIT_TIMELINE``) as
an ``autotune`` event. Bucket size never changes the result: buckets only group
elementwise reductions.

Settings: ``bucket_mb=`` (a number) or ``PLAIT_BUCKET_MB`` fixes the size (no
tuning), and so does Horovod's ``HOROVOD_FUSION_THRESHOLD`` (bytes; what
``horovodrun --fusion-threshold-mb`` sets) unless ``HOROVOD_AUTOTUNE=1``;
``PLAIT_AUTOTUNE=0`` turns tuning off (the default size is used);
``PLAIT_AUTOTUNE_STEPS`` is the number of timed steps per candidate (default 2);
``PLAIT_AUTOTUNE_MB`` the comma-separated candidate sizes in MiB (default
``1,4,16,64``). Every rank must use the same settings (``plait run`` forwards
``PLAIT_*`` and ``HOROVOD_*``).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence

from plait.errors import invalid

__all__ = ["CANDIDATES_MB", "BucketTuner", "bucket_setting", "candidates"]

#: Bucket sizes (MiB) tried, smallest first.
CANDIDATES_MB = (1.0, 4.0, 16.0, 64.0)


def _number(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise invalid(name, raw, "a size in MiB >= 0 (0: one gradient per bucket)")
    return value


def _fusion_threshold_mb(env: Mapping[str, str]) -> float | None:
    """Horovod's ``HOROVOD_FUSION_THRESHOLD`` (bytes) in MiB, or None when unset."""
    raw = env.get("HOROVOD_FUSION_THRESHOLD", "").strip()
    if raw == "":
        return None
    if not raw.isdigit():
        raise invalid("HOROVOD_FUSION_THRESHOLD", raw,
                      "a whole number of bytes >= 0 (0: one gradient per bucket)")
    return int(raw) / 2**20


def bucket_setting(bucket_mb: float | None, default_mb: float,
                   env: Mapping[str, str] | None = None) -> tuple[float, bool]:
    """Resolve the bucket size setting.

    Args:
        bucket_mb: the argument given (None: not given).
        default_mb: the size used when tuning is off and nothing is set.
        env: environment (default ``os.environ``).

    Returns:
        ``(size in MiB to start with, whether to tune)``.

    Raises:
        ConfigError: for a negative ``bucket_mb``, a bad ``PLAIT_BUCKET_MB``,
            ``HOROVOD_FUSION_THRESHOLD``, ``PLAIT_AUTOTUNE`` or ``PLAIT_AUTOTUNE_STEPS``.
    """
    env = os.environ if env is None else env
    if bucket_mb is not None:
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb >= 0:
            raise invalid("bucket_mb", bucket_mb, "a size in MiB >= 0 (0: one gradient per bucket), "
                          "or None to tune it in the first steps")
        return float(bucket_mb), False
    fixed = _number(env, "PLAIT_BUCKET_MB")
    if fixed is not None:
        return fixed, False
    fusion = _fusion_threshold_mb(env)
    if fusion is not None and env.get("HOROVOD_AUTOTUNE", "").strip().lower() not in ("1", "true"):
        return fusion, False
    raw = env.get("PLAIT_AUTOTUNE", "1").strip().lower()
    if raw not in ("0", "1", "false", "true", "off", "on", "no", "yes", ""):
        raise invalid("PLAIT_AUTOTUNE", raw, "1/on (default) or 0/off")
    tune = raw not in ("0", "false", "off", "no")
    _steps(env)  # validated early
    return (candidates(env)[0] if tune else default_mb), tune


def candidates(env: Mapping[str, str] | None = None) -> list[float]:
    """The candidate sizes: ``PLAIT_AUTOTUNE_MB`` or :data:`CANDIDATES_MB`.

    Raises:
        ConfigError: for a list that is empty or has a negative or unreadable size.
    """
    env = os.environ if env is None else env
    raw = env.get("PLAIT_AUTOTUNE_MB", "")
    if raw.strip() == "":
        return list(CANDIDATES_MB)
    try:
        sizes = [float(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(not x >= 0 for x in sizes):
        raise invalid("PLAIT_AUTOTUNE_MB", raw, "comma-separated sizes in MiB >= 0, e.g. 1,4,16,64")
    return sizes


def _steps(env: Mapping[str, str]) -> int:
    raw = env.get("PLAIT_AUTOTUNE_STEPS", "")
    if raw == "":
        return 2
    if not raw.isdigit() or int(raw) < 1:
        raise invalid("PLAIT_AUTOTUNE_STEPS", raw, "a whole number >= 1")
    return int(raw)


class BucketTuner:
    """Which bucket size to use at each step while tuning, and the final choice.

    Args:
        sizes: bucket sizes (MiB) to try, in order (default :func:`candidates`).
        steps: timed steps per candidate (default ``PLAIT_AUTOTUNE_STEPS`` or 2).
        skip: untimed steps after each change.
    """

    def __init__(self, sizes: Sequence[float] | None = None, steps: int | None = None,
                 skip: int = 2) -> None:
        sizes = candidates() if sizes is None else list(sizes)
        if not sizes:
            raise invalid("sizes", sizes, "at least one bucket size")
        self.candidates = [float(c) for c in sizes]
        self.steps = _steps(os.environ) if steps is None else int(steps)
        self.skip = skip
        self.samples: list[list[float]] = [[] for _ in self.candidates]
        self._index = 0
        self._seen = 0
        self.choice: float | None = None

    @property
    def current(self) -> float:
        """The bucket size (MiB) to use now."""
        if self.choice is not None:
            return self.choice
        return self.candidates[min(self._index, len(self.candidates) - 1)]

    @property
    def tuning(self) -> bool:
        return self.choice is None

    @property
    def measured(self) -> bool:
        """True once every candidate was measured or dropped."""
        return self._index >= len(self.candidates)

    def drop_current(self) -> None:
        """Skip the current candidate (e.g. it gives the same buckets as an earlier one)."""
        self.samples[self._index] = [float("inf")]
        self._advance()

    def observe(self, seconds: float) -> bool:
        """Record one step's time (the first ``skip`` after a change are ignored).

        Returns:
            True when the candidate to use changed (or all are measured).
        """
        self._seen += 1
        if self._seen > self.skip:
            self.samples[self._index].append(seconds)
        if len(self.samples[self._index]) >= self.steps:
            self._advance()
            return True
        return False

    def _advance(self) -> None:
        self._index += 1
        self._seen = 0

    def medians(self) -> list[float]:
        """This rank's median step time per candidate (inf for dropped ones)."""
        return [statistics.median(s) if s else float("inf") for s in self.samples]

    def decide(self, agreed: Sequence[float]) -> float:
        """Pick the candidate with the smallest agreed time (the first on ties)."""
        best = min(range(len(self.candidates)), key=lambda i: (agreed[i], i))
        self.choice = self.candidates[best]
        return self.choice
