"""The small shared helpers: one home for each rule that several modules write."""

from __future__ import annotations

import pytest

from imgtrainer.errors import first_line, message_line


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
