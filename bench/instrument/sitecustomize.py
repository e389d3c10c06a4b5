"""The start-and-end timeline of bench/startup.py, loaded at interpreter start-up from PYTHONPATH
(``timeline_env``) by the launcher, torchrun's agent and every rank.

With $TRAIN_DDP_TIMELINE naming a file, each phase's end appends "time process event" to that
file. Inside the trainer the marks come from a hook named in $IMGTRAINER_HOOKS
(``imgtrainer.hooks.declared_hooks``); the launcher's, the agent's and the worker's phases
outside it come from their functions, wrapped as their modules are imported.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time

TIMELINE_ENV = "TRAIN_DDP_TIMELINE"
HOOKS_ENV = "IMGTRAINER_HOOKS"  # imgtrainer.hooks.HOOKS_ENV (not imported: torch at start-up)
INTERPRETER_STARTED = time.time()  # a spawned rank's start: before it imports anything
INTERPRETER_PID = os.getpid()
_marked: set[str] = set()


def timeline_env(path: os.PathLike | str) -> dict[str, str]:
    """The environment that makes a run write its timeline to ``path``."""
    folder = os.path.dirname(os.path.abspath(__file__))
    python_path = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH", "")]))
    return {TIMELINE_ENV: str(path), "PYTHONPATH": python_path}


def mark(event: str, at: float | None = None, who: str | None = None) -> None:
    """Append "time process event" to the timeline, once per event and process; the process is
    ``who``, else the rank, else the launcher."""
    if event in _marked:
        return
    _marked.add(event)
    if who is None:
        who = f"rank{os.environ['RANK']}" if "RANK" in os.environ else "launcher"
    # One short append per line: lines from several processes do not interleave.
    with open(os.environ[TIMELINE_ENV], "a") as timeline:
        timeline.write(f"{time.time() if at is None else at:.6f} {who} {event}\n")


def marking(function, before: str | None = None, after: str | None = None, who: str | None = None):
    """``function``, marking ``before`` when it is called and ``after`` when it returns."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if before:
            mark(before, who=who)
        result = function(*args, **kwargs)
        if after:
            mark(after, who=who)
        return result

    return wrapper


def wrap(owner, name: str, **events) -> None:
    setattr(owner, name, marking(getattr(owner, name), **events))


def install_launcher(module) -> None:
    wrap(module, "main", before="launcher start")
    wrap(module, "run_forwarding_signals", before="torchrun start", after="torchrun exited")


def install_agent(module) -> None:
    wrap(module, "preload", after="agent imports done", who="agent")


def install_train(module) -> None:
    run_as_script = module.run_as_script

    @functools.wraps(run_as_script)
    def run_as_script_marked(*args, **kwargs):
        # A spawned rank started with this interpreter; a forked one starts here, its imports
        # done in the agent.
        forked = os.getpid() != INTERPRETER_PID
        mark("worker start", at=None if forked else INTERPRETER_STARTED)
        mark("imports done")
        return run_as_script(*args, **kwargs)

    module.run_as_script = run_as_script_marked
    wrap(module, "setup_distributed", after="process group ready")
    wrap(module, "log_summary", after="summary logged")
    wrap(module, "cleanup_distributed", after="process group destroyed")
    wrap(module, "exit_now", before="worker exit")


def install_image_plan(module) -> None:
    # The decode check starts in the background (the first step does not wait for it); the
    # GPU cache decodes every image first, which is its check (the RAM cache fills during the
    # first epoch).
    wrap(module, "decode_up_front", after="images cached")
    wrap(module, "DecodeCheck", after="data check started")


def timeline_hook(trainer):
    """Marks "model ready" (the hooks are made once the model is built and resumed) and returns
    the hook that marks the first step, before its checkpoint."""
    from imgtrainer.hooks import Hook

    class FirstStep(Hook):
        before_checkpoint = True

        def on_step_end(self, info) -> bool:
            mark("first step done")
            return False

    mark("model ready")
    return FirstStep()


def declare_hooks(environ=os.environ) -> None:
    """Name ``timeline_hook`` in $IMGTRAINER_HOOKS (once: the processes that this one starts
    inherit it)."""
    declared = [e for e in environ.get(HOOKS_ENV, "").split(",") if e]
    entry = f"{__name__}:timeline_hook"
    if entry not in declared:
        environ[HOOKS_ENV] = ",".join([*declared, entry])


INSTALLERS = {
    "imgtrainer.run.launcher": install_launcher,
    "imgtrainer.run.quick_exit": install_agent,
    "imgtrainer.run.train": install_train,
    "imgtrainer.data.image_plan": install_image_plan,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules of ``INSTALLERS`` with the usual finders, and wraps their functions
    after each one runs."""

    def find_spec(self, name, path, target=None):
        if name not in INSTALLERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_install(module) -> None:
            exec_module(module)
            INSTALLERS[name](module)

        spec.loader.exec_module = exec_and_install
        return spec


if os.environ.get(TIMELINE_ENV):
    sys.meta_path.insert(0, _AfterImport())
    declare_hooks()
