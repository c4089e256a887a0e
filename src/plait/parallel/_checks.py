"""Argument checks shared by the pure parallel modules (private)."""

from __future__ import annotations

__all__ = ["check_int"]


def check_int(
    name: str,
    value: object,
    *,
    minimum: int,
    value_error: type[ValueError],
    type_error: type[TypeError],
) -> int:
    """Return ``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum``.

    Args:
        name: The argument name used in the error message.
        value: The value to check.
        minimum: The smallest valid value.
        value_error: Raised when the value is too small.
        type_error: Raised when the value is not an integer.

    Returns:
        ``value`` as an ``int``.

    Raises:
        type_error: ``value`` is not an integer (``bool`` is rejected).
        value_error: ``value < minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(
            f"{name} must be an integer >= {minimum}, got {value!r} "
            f"of type {type(value).__name__}"
        )
    if value < minimum:
        raise value_error(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
