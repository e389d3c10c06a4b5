"""Logging per module under one project logger: set up for a tool's run and undone after it; the
level is written by the format, never by hand."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

import imgtrainer.data.loaders as data
import imgtrainer.training.step as training_step
from conftest import SRC
from imgtrainer.distributed.logs import PROJECT_LOGGER, logging_for_run
from imgtrainer.distributed.setup import DistInfo

MAIN = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
OTHER = DistInfo(rank=1, local_rank=1, world_size=2, local_world_size=2, device=torch.device("cpu"))


def test_module_loggers_are_children_of_the_project_logger():
    project = logging.getLogger(PROJECT_LOGGER)
    for module in (data, training_step):
        assert module.log.name == module.__name__
        assert module.__name__.startswith(f"{PROJECT_LOGGER}.")
        assert module.log.parent is project


def test_a_run_logs_to_its_rank_file_and_leaves_the_logger_as_it_was(tmp_path: Path, capsys):
    project = logging.getLogger(PROJECT_LOGGER)
    before = list(project.handlers), project.level, project.propagate
    with logging_for_run(tmp_path, MAIN, name="tool"):
        data.log.info("an information")
        training_step.log.warning("a warning")
        files = [h for h in project.handlers if isinstance(h, logging.FileHandler)]
    assert (list(project.handlers), project.level, project.propagate) == before
    assert files and all(h.stream is None for h in files)  # closed
    out = capsys.readouterr().out
    assert out.splitlines() == ["an information", "WARNING: a warning"]
    text = (tmp_path / "tool_rank_0.log").read_text()
    assert "[rank 0] an information" in text and "[rank 0] WARNING: a warning" in text


def test_other_ranks_write_their_file_and_print_nothing(tmp_path: Path, capsys):
    with logging_for_run(tmp_path, OTHER, name="tool"):
        training_step.log.warning("from rank 1")
    assert capsys.readouterr().out == ""
    assert "[rank 1] WARNING: from rank 1" in (tmp_path / "tool_rank_1.log").read_text()


def test_no_log_call_writes_its_level_by_hand():
    pattern = re.compile(r"log\.\w+\(f?[\"'](WARNING|ERROR|INFO):")
    offenders = [
        f"{path.name}:{n}"
        for path in sorted(SRC.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
