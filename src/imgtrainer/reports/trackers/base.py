"""What every tracker shares: a hook whose calls never end the training run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from imgtrainer.errors import first_line
from imgtrainer.hooks import Hook

log = logging.getLogger(__name__)


class TrackerHook(Hook):
    """A tracker on the main process. Once the run trains, a tracker that fails (its server
    gone) is switched off with one warning: the training goes on without it."""

    name = "tracker"
    where = ""  # where its records go, for the start of the run's log

    def safely(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        try:
            call(*args, **kwargs)
        except Exception as err:  # a tracker's own failure must not lose the training run
            self.enabled = False
            log.warning(f"--log_to {self.name} failed ({first_line(err)}); it is off from now on")
