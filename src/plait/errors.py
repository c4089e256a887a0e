"""Errors raised by plait.

Every error a user can trigger derives from :class:`PlaitError`; bad input is
also a ``ValueError`` or ``TypeError`` so that generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CollectiveTimeoutError",
    "ConfigError",
    "HorovodInternalError",
    "MismatchError",
    "NotInitializedError",
    "PlaitError",
    "PlaitTypeError",
]


class PlaitError(Exception):
    """Base class of every plait error."""


class ConfigError(PlaitError, ValueError):
    """An argument or setting has a value that is not valid.

    The message names the argument, shows the value and says what is valid.
    """


class NotInitializedError(PlaitError, ValueError):
    """plait was used before ``init()`` or after ``shutdown()`` (a ``ValueError``, as
    Horovod's "Horovod has not been initialized")."""


class PlaitTypeError(PlaitError, TypeError):
    """An argument has a type plait cannot handle."""


class BackendUnavailableError(PlaitError, ImportError):
    """A communication backend or framework was asked for but cannot be used here."""


class HorovodInternalError(PlaitError, RuntimeError):
    """A collective failed across ranks (Horovod's ``hvd.HorovodInternalError``).

    Horovod raises its ``HorovodInternalError`` (a ``RuntimeError``) when a collective
    fails, e.g. ranks submitted different shapes or Horovod shut down after a stall;
    plait's :class:`MismatchError` and :class:`CollectiveTimeoutError` derive from this
    class so that ``except hvd.HorovodInternalError`` written for Horovod catches them.
    """


class MismatchError(HorovodInternalError):
    """Ranks called different collectives (or the same one with different arguments).

    Raised on every rank of the communicator, with every rank's call in the message.
    """


class CollectiveTimeoutError(HorovodInternalError):
    """Some ranks did not reach a collective within the configured timeout."""


def invalid(argument: str, value: object, valid: str) -> ConfigError:
    """Build the standard bad-input error.

    Args:
        argument: name of the argument or setting.
        value: the value that was given.
        valid: what would have been accepted.

    Returns:
        A :class:`ConfigError` to raise.
    """
    return ConfigError(f"invalid {argument}={value!r}: expected {valid}")
