"""The lifecycle owner hooks: one list, read from the protocol."""

from __future__ import annotations

from lifecycle_harness import RecordingOwner


def test_effect_hooks_come_from_the_protocol_and_every_owner_has_them() -> None:
    """EFFECT_HOOKS is read from LifecycleEffects; the generated owners and the scheduler's
    effects implement each hook, every hook is called by some lifecycle action, and none is a
    method of the scheduler itself (the engine cannot call one)."""
    import inspect

    from statecore.bench.dispatch import NullOwner
    from statecore.lifecycle import EFFECT_HOOKS, LifecycleEffects
    from statecore.lifecycle import machines as machines_module
    from statecore.scheduler import OffloadingScheduler
    from statecore.scheduler.effects import SchedulerEffects

    declared = [n for n, v in vars(LifecycleEffects).items() if inspect.isfunction(v)]
    assert list(EFFECT_HOOKS) == [n for n in declared if not n.startswith("_")]
    source = inspect.getsource(machines_module)
    for hook in EFFECT_HOOKS:
        assert callable(getattr(NullOwner, hook)) and callable(getattr(RecordingOwner, hook))
        assert callable(getattr(SchedulerEffects, hook)), hook
        assert not hasattr(OffloadingScheduler, hook), hook
        assert f"owner.{hook}(" in source, f"no lifecycle action calls {hook}"
    owner = RecordingOwner()
    owner.stall_job(type("Job", (), {"job_id": 7})())
    assert owner.calls == [("stall_job", 7)]
