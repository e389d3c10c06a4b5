"""The loop's declared hook points: registration checks the method names, hooks run in the
order registered, and the trainer's own per-step work is made of hooks."""

from __future__ import annotations

import pytest
import torch

from imgtrainer.hooks import HOOK_POINTS, Hook, Hooks, StepInfo
from imgtrainer.training.loop import ProgressBar


def info(step: int) -> StepInfo:
    return StepInfo(step, step, torch.zeros(3))


def test_a_misspelt_hook_method_is_rejected_at_registration():
    class Misspelt(Hook):
        def on_step_ned(self, info) -> bool:
            return False

    with pytest.raises(TypeError, match="on_step_ned"):
        Hooks().register(Misspelt())
    with pytest.raises(TypeError, match="on_step_ned"):
        Hooks([Misspelt()])


def test_only_hooks_register():
    class DuckTyped:
        def on_step_end(self, info) -> bool:
            return False

    with pytest.raises(TypeError, match="DuckTyped"):
        Hooks().register(DuckTyped())


def test_hooks_run_in_registration_order_and_any_of_them_stops():
    calls = []

    class Named(Hook):
        def __init__(self, name: str, stop: bool = False):
            self.name, self.stop = name, stop

        def on_step_end(self, info) -> bool:
            calls.append((self.name, info.step))
            return self.stop

        def on_epoch_end(self, epoch: int, record: dict) -> None:
            calls.append((self.name, "epoch", epoch))

    class Last(Named):
        pass

    hooks = Hooks([Named("a"), Last("z")])
    hooks.register(Named("b", stop=True), before=Last)
    assert any(hooks.call("on_step_end", info(1))) is True
    hooks.call("on_epoch_end", 1, {})
    assert calls == [
        ("a", 1),
        ("b", 1),
        ("z", 1),
        ("a", "epoch", 1),
        ("b", "epoch", 1),
        ("z", "epoch", 1),
    ]
    with pytest.raises(ValueError):
        hooks.call("on_step_ned", info(1))


def test_only_enabled_hooks_that_implement_a_point_are_selected():
    class Stepper(Hook):
        def on_step_end(self, info) -> bool:
            return False

    bar_on, bar_off = ProgressBar(enabled=True), ProgressBar(enabled=False)
    hooks = Hooks([Stepper(), bar_on, bar_off])
    assert list(hooks.implementing("on_log_step")) == [bar_on]
    assert HOOK_POINTS == {"on_step_end", "on_log_step", "on_epoch_end", "on_run_end"}


def test_the_trainers_per_step_work_is_made_of_hooks():
    from imgtrainer.reports.trackers.tensorboard_tracker import Tracker as TensorBoard
    from imgtrainer.training.ema import ModelEma
    from imgtrainer.training.periodic import CheckpointAndStop, PositionKeeper

    for cls in (ModelEma, PositionKeeper, CheckpointAndStop, TensorBoard, ProgressBar):
        assert issubclass(cls, Hook), cls


class Marker(Hook):
    before_checkpoint = True

    def __init__(self, context):
        self.context = context


def marker(context) -> Hook:
    return Marker(context)


def nothing_here(context) -> None:
    return None


def test_declared_hooks_are_made_from_the_environment_in_order(monkeypatch):
    from imgtrainer.errors import UserError
    from imgtrainer.hooks import HOOKS_ENV, declared_hooks

    monkeypatch.delenv(HOOKS_ENV, raising=False)
    assert declared_hooks("trainer") == []
    monkeypatch.setenv(HOOKS_ENV, f"{__name__}:marker, {__name__}:nothing_here,{__name__}:marker")
    made = declared_hooks("trainer")
    assert [type(h) for h in made] == [Marker, Marker] and made[0].context == "trainer"
    monkeypatch.setenv(HOOKS_ENV, f"{__name__}:missing")
    with pytest.raises(UserError, match=f"{HOOKS_ENV}: cannot find {__name__}:missing"):
        declared_hooks("trainer")
