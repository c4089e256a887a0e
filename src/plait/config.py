"""Settings read from arguments or ``PLAIT_*`` environment variables (stdlib only)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import invalid

__all__ = ["BACKENDS", "Config"]

#: Backend names accepted by :func:`plait.init`.
BACKENDS = ("auto", "mpi", "horovod")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise invalid(name, raw, "one of 1/0, true/false, yes/no, on/off")


@dataclass(frozen=True)
class Config:
    """How plait talks to the other ranks.

    Attributes:
        backend: "auto", "mpi" or "horovod" (``PLAIT_BACKEND``).
        check: verify that ranks agree before each collective (``PLAIT_CHECK``).
        timeout: seconds to wait for the other ranks (``PLAIT_TIMEOUT``).
        framework: which Horovod library to initialise: "torch", "tensorflow"
            or "auto" (``PLAIT_FRAMEWORK``).
    """

    backend: str = "auto"
    check: bool = True
    timeout: float = 300.0
    framework: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise invalid("backend", self.backend, f"one of {list(BACKENDS)}")
        if not self.timeout > 0:
            raise invalid("timeout", self.timeout, "a positive number of seconds")
        if self.framework not in ("auto", "torch", "tensorflow"):
            raise invalid("framework", self.framework, "one of ['auto', 'torch', 'tensorflow']")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Build a config from ``PLAIT_*`` variables, then explicit (non-None) overrides.

        Raises:
            ConfigError: when a variable or an override has an invalid value.
        """
        env = os.environ if env is None else env
        raw_timeout = env.get("PLAIT_TIMEOUT", "300")
        try:
            timeout = float(raw_timeout)
        except ValueError:
            raise invalid("PLAIT_TIMEOUT", raw_timeout, "a number of seconds") from None
        values: dict[str, object] = {
            "backend": env.get("PLAIT_BACKEND", "auto") or "auto",
            "check": _flag(env, "PLAIT_CHECK", True),
            "timeout": timeout,
            "framework": env.get("PLAIT_FRAMEWORK", "auto") or "auto",
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
