"""How a run ended, told once by the launcher: its exit code, from what each rank and torchrun's
agent reported, and the one line that says why."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from imgtrainer.errors import EXIT_RUN_FAILED
from imgtrainer.process import EXIT_HUNG, exit_code_for
from imgtrainer.run.watchdog import Verdict


def exit_code(
    torchrun_code: int,
    outcomes: list[dict],
    received: list[int],
    log_file: Path,
    hangs: Sequence[Verdict] = (),
) -> int:
    """How the run ended, from what each rank reported (first failure first) and the signals the
    launcher passed on; a failure is printed as one line naming the rank, after a bug's
    traceback. A last attempt ended by the hang watchdog (``hangs``) ends with EXIT_HUNG: the
    ranks that failed when it killed the stuck one are not blamed."""
    if torchrun_code == 0 and (
        not received or (outcomes and all(o["code"] == 0 for o in outcomes))
    ):
        # Every rank of torchrun's last round ended 0 (finished; a stop signal that came as the
        # run was ending, passed on, changed nothing). An earlier round's 143 under the same
        # restart count is a rank its agent stopped to take in a joining node.
        return 0
    if hangs and not received:
        last = hangs[-1].culprit
        if all(o["attempt"] <= last.attempt for o in outcomes):
            return report_hang(hangs[-1], log_file)
    failures = [o for o in outcomes if o["code"] not in (0, 130, 143)]
    if failures:
        return report_failure(failures[0], log_file)
    stops = [o for o in outcomes if o["code"] in (130, 143)]
    if received or stops:
        return stop_code(stops, received)
    if torchrun_code == 0:
        return 0
    print(
        f"error: torchrun exited with code {torchrun_code} and no rank said why (a rank "
        f"killed by a signal, or out of memory?); see {log_file}",
        file=sys.stderr,
        flush=True,
    )
    return torchrun_code


def report_failure(first: dict, log_file: Path) -> int:
    """The first failed rank's traceback (a bug's) and one line naming it; its exit code."""
    if first["traceback"]:
        sys.stderr.write(first["traceback"])
    reason = first["line"].removeprefix("error: ") or f"exited with code {first['code']}"
    print(
        f"error: rank {first['rank']}: {reason} (torchrun's report and every rank's "
        f"stderr: {log_file})",
        file=sys.stderr,
        flush=True,
    )
    return first["code"]


def report_agent_failure(line: str, outcomes: list[dict], code: int, log_file: Path) -> int:
    """torchrun's agent failed itself (``lifecycle.write_agent_failure``): its line, not the
    failure of a rank it could not restart (that rank's line follows it, for context)."""
    failures = [o for o in outcomes if o["code"] not in (0, 130, 143)]
    after = ""
    if failures:
        reason = failures[0]["line"].removeprefix("error: ") or f"code {failures[0]['code']}"
        after = f"; no restart was tried after rank {failures[0]['rank']}'s failure ({reason})"
    print(
        f"error: torchrun's agent failed: {line}{after} (torchrun's log: {log_file})",
        file=sys.stderr,
        flush=True,
    )
    return code


# The agent's failure when the agent that hosted the rendezvous store is gone.
LOST_STORE = "RendezvousConnectionError"


def report_lost_store(endpoint: str, resume: str, log_file: Path) -> int:
    """The agent that hosted the rendezvous store is gone: no round can be held, so no restart
    either. One line naming it and the command that continues from the kept checkpoints; exit
    code 1, a failure (130 and 143 are stops on request, 3 a hang), torchrun's own."""
    print(
        f"error: the rendezvous host {endpoint} is gone: its torchrun agent held the "
        f"job's c10d store, which a job cannot outlive (torchrun's log: {log_file}); the "
        f"checkpoints are kept: continue with `{resume}` on each node, starting on the "
        f"one that will host the rendezvous at {endpoint} (or with --rdzv_endpoint "
        "naming a node that stays)",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_RUN_FAILED


def report_hang(verdict: Verdict, log_file: Path) -> int:
    """The end of a run whose last attempt the watchdog ended (its line is printed already)."""
    culprit = verdict.culprit
    print(
        f"error: {culprit.who} (pid {culprit.pid}) made no progress for --hang_timeout; its "
        f"stacks and torchrun's report are in {log_file.parent}. The run continues from its "
        "newest checkpoint with the same command plus --resume auto",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_HUNG


def stop_code(stops: list[dict], received: list[int]) -> int:
    """The exit code of a stopped run: the signal's that the launcher passed on, else the
    ranks'; their reason is printed when every stopped rank gave one."""
    early = [o["line"] for o in stops if o["line"]]
    if early and len(early) == len(stops):
        print(early[0], file=sys.stderr, flush=True)
    return exit_code_for(received[0]) if received else stops[0]["code"]
