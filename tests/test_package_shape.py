"""Configs travel whole: no function of the product takes more than 6 parameters. Module
docstrings say what a module is in a few lines; the long explanations live in docs/."""

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAMS = 6
MAX_DOCSTRING_LINES = 8


def _product_files() -> list[Path]:
    return sorted((ROOT / "src" / "imgtrainer").rglob("*.py")) + [ROOT / "launch_ddp.py"]


def _scripts() -> list[Path]:
    """The thin scripts users type."""
    return sorted((ROOT / "src").glob("*.py"))


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _param_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    count = len(names) + len(args.kwonlyargs)
    return count + (args.vararg is not None) + (args.kwarg is not None)


def _offenders() -> list[str]:
    found = []
    for path in _product_files():
        tree = _tree(path)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            n = _param_count(node)
            if n <= MAX_PARAMS:
                continue
            qual, up = [node.name], parents.get(node)
            while up is not None:
                if isinstance(up, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    qual.insert(0, up.name)
                up = parents.get(up)
            found.append(f"{path.relative_to(ROOT).as_posix()}:{'.'.join(qual)} ({n})")
    return found


def test_no_function_takes_more_than_six_parameters():
    offenders = _offenders()
    assert not offenders, "functions over 6 parameters:\n" + "\n".join(offenders)


def test_module_docstrings_are_a_few_lines():
    long = []
    for path in _product_files() + _scripts():
        doc = ast.get_docstring(_tree(path))
        lines = len(doc.splitlines()) if doc else 0
        if lines > MAX_DOCSTRING_LINES:
            long.append(f"{path.relative_to(ROOT).as_posix()} ({lines} lines)")
    assert not long, (
        f"module docstrings over {MAX_DOCSTRING_LINES} lines (the rest belongs in docs/):\n"
        + "\n".join(long)
    )
