"""The small shared helpers: one home for each rule that several modules write."""

from __future__ import annotations

from pathlib import Path

import pytest

from imgtrainer.checkpoints.resume import find_resume_checkpoint
from imgtrainer.checkpoints.run_folder import explicit_resume_file
from imgtrainer.errors import UserError, first_line, message_line
from imgtrainer.files import format_bytes
from imgtrainer.reports.figures import new_figure, pyplot, save_figure


@pytest.mark.parametrize(
    ("err", "line"),
    [
        (ValueError("bad value"), "ValueError: bad value"),
        (
            RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported"),
            "RuntimeError: CUDA error: out of memory",
        ),
        (KeyError("zebra"), "KeyError: 'zebra'"),
        (OSError(), "OSError"),
        (ValueError("  \n\n  second line first  \n"), "ValueError: second line first"),
    ],
)
def test_first_line_is_the_type_and_the_first_line_of_the_message(err, line):
    assert first_line(err) == line


def test_first_line_takes_another_name_or_a_cleaned_message():
    err = ValueError("\x1b[31mred\x1b[0m")
    assert first_line(err, name="pkg.Error", text="red\nmore") == "pkg.Error: red"
    assert first_line(err, text=" ") == "ValueError"
    assert message_line("") == "" and message_line("\n  a  \nb") == "a"


@pytest.mark.parametrize(
    ("n", "unit", "digits", "text"),
    [
        (0, None, None, "0 B"),
        (1023, None, None, "1023 B"),
        (1024, None, None, "1.0 KiB"),
        (12 * 2**20, None, None, "12.0 MiB"),
        (2**40, None, None, "1024.0 GiB"),
        (2**29, "GiB", 2, "0.50 GiB"),  # as training.memory.gib
        (512 * 2**20 + 7, "MiB", 0, "512 MiB"),  # as the inline "/ 2**20:.0f MiB"
    ],
)
def test_format_bytes(n, unit, digits, text):
    assert format_bytes(n, unit, digits) == text


def test_save_figure_writes_a_png_and_closes_the_figure(tmp_path: Path):
    fig, ax = new_figure(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    output = tmp_path / "made" / "here.png"
    save_figure(fig, output, dpi=50)
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not pyplot().fignum_exists(fig.number)


def test_a_missing_resume_file_is_the_same_line_before_and_after_the_launch(tmp_path: Path):
    missing = str(tmp_path / "missing.pth")
    lines = []
    for check in (explicit_resume_file, lambda resume: find_resume_checkpoint(resume, tmp_path)):
        with pytest.raises(UserError) as err:
            check(missing)
        lines.append(str(err.value))
    assert lines == [f"--resume {missing}: no such file"] * 2
    (tmp_path / "here.pth").write_bytes(b"")
    assert find_resume_checkpoint(str(tmp_path / "here.pth"), tmp_path) == tmp_path / "here.pth"
