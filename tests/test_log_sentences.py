"""No module knows another module's log sentence: what the report page and the tools need of a
run comes from its events (``imgtrainer.events``), so a sentence can be reworded freely.

The check reads the product's source: the literal pieces of every sentence a module logs (to a
logger, to torchrun.log, the watchdog's lines; through the functions that make them), and every
literal another module matches text with (``startswith`` and kin, ``in``, ``==``, a regular
expression); a match of one in the other, outside the module that writes it, is a failure."""

from __future__ import annotations

import ast
import functools
import re

from test_package_shape import ROOT, _product_files, _tree

# The calls whose first argument is a sentence for people.
SAYING = {"debug", "info", "warning", "error", "exception", "critical", "say", "write"}
# The methods whose argument is text looked for in other text.
MATCHING = {"startswith", "endswith", "removeprefix", "removesuffix", "find", "index", "rfind"}
MATCHING |= {"partition", "rpartition", "split", "count"}
REGEX = {"compile", "match", "search", "fullmatch", "findall", "finditer", "sub", "split"}
# Text that names a thing (a key, a suffix, a flag's value) rather than a piece of a sentence.
A_NAME = re.compile(r"[\w.\-/*]+")


def strings(node: ast.AST) -> list[str]:
    """The literal strings in ``node``'s subtree: a sentence's pieces around its values."""
    return [
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def called_names(node: ast.AST) -> set[str]:
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            func = n.func
            names.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
    return names - {""}


def returned(trees: dict[str, ast.Module]) -> dict[str, list[tuple[str, ast.AST]]]:
    """What each function of the package (by name) returns, with the module that holds it."""
    found: dict[str, list[tuple[str, ast.AST]]] = {}
    for module, tree in trees.items():
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef):
                values = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value]
                found.setdefault(fn.name, []).extend((module, value) for value in values)
    return found


def sentence_pieces(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Each module's literal pieces of the sentences it logs, with those of the functions that
    make them (followed three calls deep), credited to the module that holds the literal."""
    makers = returned(trees)
    pieces: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and says(call.func) and call.args):
                continue
            nodes, seen = [(module, call.args[0])], set()
            for _ in range(3):
                more = []
                for home, node in nodes:
                    texts = [t for t in strings(node) if len(t.strip()) >= 3]
                    pieces.setdefault(home, set()).update(texts)
                    for name in called_names(node) - seen:
                        seen.add(name)
                        more += makers.get(name, [])
                nodes = more
    return pieces


def says(func: ast.expr) -> bool:
    """A logger's call, the watchdog's ``say``, or a write to a log file (``log.write``; not
    the console's)."""
    attr, owner = getattr(func, "attr", ""), getattr(func, "value", None)
    if attr == "write":
        return isinstance(owner, ast.Name) and "log" in owner.id
    return attr in SAYING


def regex_text(pattern: str) -> str:
    """The literal text a regular expression starts with (up to its first special character)."""
    text, escaped = "", False
    for char in pattern.removeprefix("^"):
        if escaped:
            text, escaped = text + char, False
        elif char == "\\":
            escaped = True
        elif char in "()[]{}.*+?^$|":
            if text:
                break
        else:
            text += char
    return text


@functools.cache
def matched_literals(tree: ast.Module) -> list[str]:
    """The literals ``tree`` looks for in text, its module-level names for them resolved."""
    constants = {
        node.targets[0].id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }

    def literals(node: ast.AST) -> list[str]:
        node = constants.get(node.id, node) if isinstance(node, ast.Name) else node
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "compile":
            return [regex_text(s) for s in strings(node.args[0])] if node.args else []
        return strings(node) if isinstance(node, ast.Constant | ast.Tuple | ast.List) else []

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            attr, owner = getattr(node.func, "attr", ""), getattr(node.func, "value", None)
            if isinstance(owner, ast.Name) and owner.id == "re" and attr in REGEX:
                found += [regex_text(s) for s in literals(node.args[0])]
            elif attr in MATCHING:
                found += literals(node.args[0])
        elif isinstance(node, ast.Compare):
            found += compared(node, literals)
    return [text.strip() for text in found if is_sentence_like(text)]


def compared(node: ast.Compare, literals) -> list[str]:
    """The literals looked for with ``in`` (its left side) or compared with ``==``."""
    found, sides = [], [node.left, *node.comparators]
    for op, left, right in zip(node.ops, sides, sides[1:], strict=False):
        if isinstance(op, ast.In | ast.NotIn):
            found += literals(left)
        elif isinstance(op, ast.Eq | ast.NotEq):
            found += literals(left) + literals(right)
    return found


def is_sentence_like(raw: str) -> bool:
    """Words, or a marker before them: not a name, nor punctuation alone ("://")."""
    text = raw.strip()
    wordy = " " in raw or any(c.isalpha() for c in text)
    return len(text) >= 3 and wordy and not A_NAME.fullmatch(text)


def sentence_matches(
    trees: dict[str, ast.Module], pieces: dict[str, set[str]] | None = None
) -> list[str]:
    """Every match, as "module: 'literal' matches a sentence of other_module" (``pieces``:
    the trees' ``sentence_pieces``, found here when not given)."""
    pieces = pieces or sentence_pieces(trees)
    found = []
    for name, tree in trees.items():
        for literal in matched_literals(tree):
            for home, texts in pieces.items():
                if home != name and any(overlap(literal, text) for text in texts):
                    found.append(f"{name}: {literal!r} matches a sentence of {home}")
    return sorted(set(found))


def overlap(literal: str, piece: str) -> bool:
    """The literal is in the sentence's piece, or a piece of words is in the literal (the
    literal "Training data:" holds the piece " data: " of f"{role} data: ...")."""
    return literal in piece or (
        len(piece.strip()) >= 5 and is_sentence_like(piece) and piece.strip() in literal
    )


def product_trees() -> dict[str, ast.Module]:
    return {path.relative_to(ROOT).as_posix(): _tree(path) for path in _product_files()}


def test_no_module_matches_another_modules_log_sentence():
    found = sentence_matches(product_trees())
    assert not found, "log sentences used as data (use an event):\n" + "\n".join(found)


PLANTED = {
    "startswith": 'def ending(line):\n    return line.startswith("Resumed from ")\n',
    "in": 'def hangs(lines):\n    return [x for x in lines if "watchdog:" in x]\n',
    "==": 'def done(line):\n    return line[:13] == "Stopped early"\n',
    "a regex": 'import re\nRERUN = re.compile(r"\\(rerun: (.+)\\)$")\n',
    "a marker": 'def launches(line):\n    return line.startswith("=== ")\n',
}
# The keys the report page's reader of the log matched before the events.
OLD_KEYS = ("Configuration: ", "Done: ", "Stopped early", "Stopped at epoch", "Training data:")
OLD_KEYS += ("Validation data:", "Image cache:", "Loader:", "Memory:", "Effective batch:")


def test_the_check_finds_a_sentence_matched_elsewhere():
    trees, where = product_trees(), "src/imgtrainer/reports/page/planted.py"
    pieces = sentence_pieces(trees)  # the planted modules log nothing
    for how, source in PLANTED.items():
        found = sentence_matches({**trees, where: ast.parse(source)}, pieces)
        assert len(found) == 1 and found[0].startswith(f"{where}: "), (how, found)
    source = f"KEYS = {OLD_KEYS!r}\ndef kind(line):\n    return line.startswith(KEYS)\n"
    found = sentence_matches({**trees, where: ast.parse(source)}, pieces)
    assert {line.split("'")[1] for line in found} == {key.strip() for key in OLD_KEYS}, found
