"""The rules for the coordinator's timing options, written once.

:func:`dist.ensure_built` checks its arguments with :func:`timing_problem`, and
``hf_pipeline.config`` checks the ``coord.*`` fields with the same function, so any
configuration that loads is one the coordinator accepts, and the user reads the rule
under the name they set it by.
"""

from __future__ import annotations

__all__ = ["TIMING_FIELDS", "timing_problem"]

#: The timing options, as :func:`dist.ensure_built` and ``coord.*`` name them.
TIMING_FIELDS = ("poll_interval", "max_wait", "lease_timeout", "heartbeat_interval")


def timing_problem(
    *,
    poll_interval: float,
    max_wait: float,
    lease_timeout: float,
    heartbeat_interval: float,
    prefix: str = "",
) -> tuple[str, str] | None:
    """The first rule the timing options break, or None if they are valid.

    Args:
        poll_interval, max_wait, lease_timeout, heartbeat_interval: seconds, as for
            :func:`dist.ensure_built`.
        prefix: put before every field name in the result (``"coord."``).

    Returns:
        ``(field, message)`` with ``field`` the prefixed name of the offending option
        and ``message`` one line naming it: ``"poll_interval must be > 0, got 0"``.
    """
    values = {
        "poll_interval": poll_interval,
        "max_wait": max_wait,
        "lease_timeout": lease_timeout,
        "heartbeat_interval": heartbeat_interval,
    }
    for name in TIMING_FIELDS:
        value = values[name]
        # `not value > 0` also refuses NaN.
        if not isinstance(value, (int, float)) or not value > 0:
            return prefix + name, f"{prefix}{name} must be > 0, got {value!r}"
    if heartbeat_interval * 2 > lease_timeout:
        # A waiter judges a builder dead after lease_timeout without a new heartbeat: with
        # fewer than two beats per lease_timeout one late beat makes a live builder dead.
        hb, lt = prefix + "heartbeat_interval", prefix + "lease_timeout"
        return hb, (
            f"{hb} must be <= {lt} / 2 (else live builders look dead), got "
            f"{heartbeat_interval} with {lt} {lease_timeout}"
        )
    return None
