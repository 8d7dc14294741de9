"""Typed errors raised by statecore.

Every error that concerns an entity names the entity, its state and the event (or call) that
was rejected, so that a log line alone tells what happened. All errors derive from
:class:`StatecoreError`; several also derive from the builtin they refine (``ValueError``,
``KeyError``, ``TypeError``) so that existing ``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "InvariantViolation",
    "KeyNotReadyError",
    "LifecycleError",
    "ManagerError",
    "MetadataError",
    "PinUnderflowError",
    "SpecError",
    "StatecoreError",
    "TransferError",
    "UnknownKeyError",
    "UnknownRequestError",
]


class StatecoreError(Exception):
    """Base class of every error statecore raises on purpose."""


class ConfigError(StatecoreError, ValueError):
    """A configuration value is out of range or inconsistent with another one."""


class LifecycleError(StatecoreError):
    """An event is not allowed in the entity's current lifecycle state.

    Attributes:
        entity: the kind of entity (``"request"`` or ``"job"``).
        entity_id: its identifier (request id or job id).
        state: the name of the state it was in; it is still in that state.
        event: the name of the rejected event.
    """

    def __init__(self, entity: str, entity_id: object, state: str, event: str) -> None:
        self.entity = entity
        self.entity_id = entity_id
        self.state = state
        self.event = event
        super().__init__(
            f"{entity} {entity_id!r} in state {state!r} does not accept event {event!r}"
        )


class UnknownRequestError(StatecoreError, KeyError):
    """A call names a request id that statecore does not track."""

    def __init__(self, req_id: object, call: str) -> None:
        self.req_id = req_id
        self.call = call
        super().__init__(f"{call}: request {req_id!r} is not tracked")

    def __str__(self) -> str:  # KeyError would repr() the message otherwise
        return str(self.args[0])


class MetadataError(StatecoreError, TypeError):
    """Connector or worker metadata has the wrong type or an impossible shape."""


class SpecError(StatecoreError, ValueError):
    """A load/store spec does not match the KV-cache layout it is applied to."""


class ManagerError(StatecoreError):
    """Base class of errors raised by an :class:`~statecore.OffloadingManager`."""


class UnknownKeyError(ManagerError, KeyError):
    """A key passed to the manager is not present in it."""

    def __init__(self, key: bytes, call: str, state: str = "absent") -> None:
        self.key = key
        self.call = call
        self.state = state
        super().__init__(f"{call}: key {key.hex()} is {state}")

    def __str__(self) -> str:
        return str(self.args[0])


class KeyNotReadyError(ManagerError):
    """A key passed to ``prepare_load`` is present but its write has not completed."""

    def __init__(self, key: bytes, call: str) -> None:
        self.key = key
        self.call = call
        super().__init__(f"{call}: key {key.hex()} is write-pending, not ready")


class PinUnderflowError(ManagerError):
    """``complete_load`` for a key that is not pinned (INV-PIN).

    ``state`` says what the key is instead (ready and idle, or write-pending).
    """

    def __init__(
        self, key: bytes, call: str, state: str = "ready but not pinned (ref count 0)"
    ) -> None:
        self.key = key
        self.call = call
        self.state = state
        super().__init__(f"{call}: key {key.hex()} is {state}")


class TransferError(StatecoreError):
    """A transfer backend could not execute a job (the worker turns it into a failed job)."""


class InvariantViolation(StatecoreError, AssertionError):
    """A named invariant (``INV-*``) does not hold. Raised by checked mode and the fuzzers."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")
