"""docs/flags.md, the reference of every flag, generated from the parsers that ``--help`` prints.

    PYTHONPATH=src python -m dev.flag_docs           # rewrite docs/flags.md
    PYTHONPATH=src python -m dev.flag_docs --check   # exit 1 when it is out of date

The groups, option strings, help and choices come from ``build_parser()`` of the launcher and of
the trainer; the trainer's defaults from the ``TrainConfig`` fields. Nothing is copied here, so a
new flag or group reaches the docs when this is run (tests/test_docs.py fails until it is).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from imgtrainer import config
from imgtrainer.run import launcher

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
REGENERATE = "PYTHONPATH=src python -m dev.flag_docs"

# The "(default: X)" that ends a help string; the table has a column for it.
_DEFAULT_SUFFIX = re.compile(r"\s*\(default: ([^()]*(?:\([^()]*\)[^()]*)*)\)$")


def render() -> str:
    """The whole of docs/flags.md."""
    defaults = {f.name: f.default for f in config_fields() if f.default is not dataclasses.MISSING}
    lines = [
        "# Flags",
        "",
        f"Generated from the parsers by `{REGENERATE}`: do not edit it by hand.",
        "",
        "Every flag of `launch_ddp.py` and of `src/train_ddp.py`, as `--help` lists them. The "
        "launcher reads its own flags and passes every other flag unchanged to the trainer, so "
        "all the trainer's flags below are also accepted by `launch_ddp.py`. Any flag can also "
        "come from a YAML run file (`--config`, see [usage.md](usage.md#run-files---config)).",
        "",
        "## Launcher flags (`launch_ddp.py`)",
        "",
        *_table(a for a in launcher.build_parser()._actions if "--help" not in a.option_strings),
        "",
        "## Trainer flags (`src/train_ddp.py`, also accepted by the launcher)",
    ]
    for group in config.build_parser()._action_groups:
        actions = [a for a in group._group_actions if "--help" not in a.option_strings]
        if actions:
            lines += ["", f"### {group.title}", "", *_table(actions, defaults)]
    return "\n".join(lines) + "\n"


def config_fields(cls: type = config.TrainConfig) -> list[dataclasses.Field]:
    """The option fields of the config, each a flag: a field holding a sub-config stands for
    that sub-config's fields."""
    leaves = []
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        if dataclasses.is_dataclass(f.default):
            leaves += config_fields(type(f.default))
        elif factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            leaves += config_fields(factory)
        else:
            leaves.append(f)
    return leaves


def _table(actions: Any, defaults: dict[str, Any] | None = None) -> list[str]:
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in actions:
        help_text, stated = _split_default(action.help or "")
        flag = ", ".join(f"`{s}`" for s in action.option_strings)
        if action.choices:
            flag += " " + "\\|".join(str(c) for c in action.choices)
        rows.append(f"| {flag} | {_default(action, defaults, stated)} | {_cell(help_text)} |")
    return rows


def _split_default(help_text: str) -> tuple[str, str | None]:
    match = _DEFAULT_SUFFIX.search(help_text)
    if match is None:
        return help_text, None
    return help_text[: match.start()], match.group(1)


def _default(action: argparse.Action, defaults: dict[str, Any] | None, stated: str | None) -> str:
    if isinstance(action, argparse._StoreFalseAction):
        return "—"  # a --no_<flag>: its flag's row holds the default
    if defaults is not None and action.dest in defaults:
        value = defaults[action.dest]
    elif action.default not in (None, argparse.SUPPRESS):
        value = action.default
    elif stated is not None:
        return _cell(stated) if " " in stated else f"`{stated}`"
    else:
        value = False if action.nargs == 0 else None
    if value is None or value == "":
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/flags.md from the flag parsers.")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when docs/flags.md differs, write nothing"
    )
    args = parser.parse_args(argv)
    text = render()
    current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else None
    if args.check:
        if current != text:
            print(f"{DOC_PATH} is out of date; regenerate it with: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    if current != text:
        DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOC_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
