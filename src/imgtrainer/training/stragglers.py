"""Stragglers: a rank consistently slower than the others, named once.

Each rank's host clocks since the ranks last agreed on a stop (``RankClock``) travel with that
agreement (``StopRequest.agreed``: no collective of their own). DDP's ranks wait for each other
in every backward, so what differs is the time each spends outside the step (waiting for data,
per-step host work), which the others then wait for. Host clocks: a slow GPU is not separated.
"""

from __future__ import annotations

import logging
import statistics
import time

from imgtrainer.events import event

log = logging.getLogger(__name__)

# A rank is a straggler when its time outside the step is this many times the others' median...
STRAGGLER_FACTOR = 1.5
# ... and at least this share of its step (a few milliseconds apart are no straggler) ...
STRAGGLER_MIN_SHARE = 0.05
# ... at this many agreements in a row.
STRAGGLER_GATHERS = 3

# RankClock.take's figures, in order.
WINDOW, WAITED, STEPPING, STEPS = range(4)


class RankClock:
    """This rank's host clocks since the last ``take``: the wall time, the time waiting for
    batches, the time inside the forward/backward/optimizer step, and the steps."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.started = time.perf_counter()
        self.waited = self.stepping = 0.0
        self.steps = 0

    def step_done(self, stepping: float, waited: float) -> None:
        self.stepping += stepping
        self.waited += waited
        self.steps += 1

    def take(self) -> list[float]:
        """The figures since the last take (``WINDOW``...``STEPS``); starts the next window."""
        figures = [time.perf_counter() - self.started, self.waited, self.stepping, self.steps]
        self.reset()
        return figures


class StragglerWatch:
    """Every rank's figures at each agreement: names a rank whose time outside the step is
    ``STRAGGLER_FACTOR`` times the other ranks' median for ``STRAGGLER_GATHERS`` agreements in
    a row (once per rank and run), and sums each rank's figures over the epoch for its record."""

    def __init__(self, hosts: list[str]):
        self.hosts = hosts
        self.clock = RankClock()
        self.streak = [0] * len(hosts)
        self.named: set[int] = set()
        self.sums = [[0.0] * 4 for _ in hosts]

    def update(self, rows: list[list[float]]) -> list[int]:
        """One agreement's figures, a row per rank; the ranks named now."""
        if len(rows) < 2 or any(row[STEPS] < 1 for row in rows):
            return []  # an agreement outside the steps (an epoch's start): no window
        for total, row in zip(self.sums, rows, strict=True):
            for i, value in enumerate(row):
                total[i] += value
        own = [(row[WINDOW] - row[STEPPING]) / row[STEPS] for row in rows]
        named = []
        for rank, row in enumerate(rows):
            others = statistics.median(own[:rank] + own[rank + 1 :])
            step = row[WINDOW] / row[STEPS]
            slow = (
                own[rank] > STRAGGLER_FACTOR * others
                and own[rank] - others > STRAGGLER_MIN_SHARE * step
            )
            self.streak[rank] = self.streak[rank] + 1 if slow else 0
            if self.streak[rank] >= STRAGGLER_GATHERS and rank not in self.named:
                self.named.add(rank)
                named.append(rank)
                log.warning(
                    f"straggler: rank {rank} on host {self.hosts[rank]} spends "
                    f"{own[rank]:.3f} s per step outside the forward/backward pass, "
                    f"{own[rank] / max(others, 1e-9):.1f}x the other ranks' {others:.3f} s, at "
                    f"{STRAGGLER_GATHERS} agreements in a row (the others wait for it every "
                    f"step); its data wait is {row[WAITED] / max(row[WINDOW], 1e-9):.0%} of its "
                    "time",
                    extra=event("straggler", rank=rank, host=self.hosts[rank]),
                )
        return named

    def epoch_figures(self) -> dict[str, float]:
        """Each rank's seconds per step, seconds per step outside the forward/backward pass and
        data-wait share over the epoch's agreements, for its history record; then resets."""
        figures = {}
        for rank, total in enumerate(self.sums):
            if total[STEPS] < 1:
                continue
            steps, window = total[STEPS], max(total[WINDOW], 1e-9)
            figures[f"rank{rank}_step_s"] = round(window / steps, 4)
            figures[f"rank{rank}_outside_step_s"] = round((window - total[STEPPING]) / steps, 4)
            figures[f"rank{rank}_data_wait_share"] = round(total[WAITED] / window, 4)
        self.sums = [[0.0] * 4 for _ in self.hosts]
        return figures
