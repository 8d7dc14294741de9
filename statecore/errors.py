"""Typed errors raised by statecore.

Every error that concerns an entity names the entity, its state and the event (or call) that
was rejected, so that a log line alone tells what happened. All errors derive from
:class:`StatecoreError`; several also derive from the builtin they refine (``ValueError``,
``KeyError``, ``TypeError``) so that existing ``except`` clauses keep working.
"""

from __future__ import annotations

import re

__all__ = [
    "ConfigError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvalidMetadataError",
    "InvariantViolation",
    "KeyNotReadyError",
    "LifecycleError",
    "ManagerError",
    "ManagerStateError",
    "MetadataError",
    "PinUnderflowError",
    "SpecError",
    "StatecoreError",
    "TransferError",
    "UnknownKeyError",
    "UnknownRequestError",
    "describe",
    "key_text",
]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def describe(value: object, limit: int = 60) -> str:
    """A short, deterministic description of a bad value for an error message.

    The value's ``repr`` (without memory addresses, cut to ``limit`` characters) followed by
    its type name, e.g. ``nan (float)``, ``None (NoneType)``, ``'7' (str)``. Never raises,
    whatever ``value`` is.
    """
    try:
        text = _ADDRESS.sub("", repr(value))
    except Exception:  # a foreign object whose __repr__ is broken
        text = "<unprintable>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{text} ({type(value).__name__})"


def key_text(key: object) -> str:
    """An offload key as hex, or :func:`describe` of whatever was passed instead of one."""
    if isinstance(key, bytes | bytearray):
        return bytes(key).hex()
    return describe(key)


class StatecoreError(Exception):
    """Base class of every error statecore raises on purpose."""


class ConfigError(StatecoreError, ValueError):
    """A configuration value has the wrong type, is out of range or is inconsistent with
    another one.

    Attributes:
        argument: the offending field (``"SchedulerConfig.num_workers"``), when there is one.
        value: the offending value.
    """

    def __init__(self, message: str, argument: str | None = None, value: object = None) -> None:
        self.argument = argument
        self.value = value
        super().__init__(message)


class InvalidArgumentError(StatecoreError, TypeError, ValueError):
    """A public call got an argument of the wrong type, shape or range; nothing changed.

    Raised by the validation layer (:mod:`statecore.validate`) at every public entry point
    before any state is touched. It derives from both ``TypeError`` and ``ValueError`` so that
    either ``except`` clause catches it.

    Attributes:
        call: the rejected call (``"update_state_after_alloc"``).
        argument: the argument, with the path into it (``"block_ids[0][2]"``).
        value: the bad value itself.
        expected: what the argument must be.
        entity: the entity the call concerns (``"request 'r1'"``), if any.
        state: that entity's state (a lifecycle state name), if known.
    """

    def __init__(
        self,
        call: str,
        argument: str,
        value: object,
        expected: str,
        entity: str | None = None,
        state: str | None = None,
    ) -> None:
        self.call = call
        self.argument = argument
        self.value = value
        self.expected = expected
        self.entity = entity
        self.state = state
        message = f"{call}: {argument} must be {expected}, got {describe(value)}"
        if entity is not None:
            message += f" [{entity}" + (f" in state {state!r}" if state is not None else "") + "]"
        super().__init__(message)


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


class InvalidMetadataError(InvalidArgumentError, MetadataError):
    """Engine-provided metadata (a request view, block lists, a scheduler output, a worker
    report, connector metadata) has a field of the wrong type or range; nothing changed."""


class SpecError(StatecoreError, ValueError):
    """A load/store spec does not match the KV-cache layout it is applied to."""


class ManagerError(StatecoreError):
    """Base class of errors raised by an :class:`~statecore.OffloadingManager`."""


class InvalidKeyError(InvalidArgumentError, ManagerError):
    """A manager or tier call got something that is not a list of offload keys, or a key
    that is not ``bytes`` of at least 4 bytes (hash + group index); nothing changed."""


class ManagerStateError(ManagerError):
    """A manager call is not allowed for the entity's current state (a request that already
    finished, ...); nothing changed.

    Attributes:
        entity: what the call concerns (``"request 'r1'"``).
        state: its state in the manager.
        call: the rejected call.
    """

    def __init__(self, entity: str, state: str, call: str) -> None:
        self.entity = entity
        self.state = state
        self.call = call
        super().__init__(f"{call}: {entity} is {state}")


class UnknownKeyError(ManagerError, KeyError):
    """A key passed to the manager is not present in it."""

    def __init__(self, key: bytes, call: str, state: str = "absent") -> None:
        self.key = key
        self.call = call
        self.state = state
        super().__init__(f"{call}: key {key_text(key)} is {state}")

    def __str__(self) -> str:
        return str(self.args[0])


class KeyNotReadyError(ManagerError):
    """A key passed to ``prepare_load`` is present but its write has not completed."""

    def __init__(self, key: bytes, call: str) -> None:
        self.key = key
        self.call = call
        super().__init__(f"{call}: key {key_text(key)} is write-pending, not ready")


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
        super().__init__(f"{call}: key {key_text(key)} is {state}")


class TransferError(StatecoreError):
    """A transfer backend could not execute a job (the worker turns it into a failed job)."""


class InvariantViolation(StatecoreError, AssertionError):
    """A named invariant (``INV-*``) does not hold. Raised by checked mode and the fuzzers."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")
