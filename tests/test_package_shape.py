"""Configs travel whole: no function of the product takes more than 6 parameters. Module
docstrings say what a module is in a few lines; the long explanations live in docs/."""

import ast
import functools
import importlib
from collections.abc import Iterator
from pathlib import Path

from dev import module_map

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


# The floors of the house, lowest first (the package map lists the rooms in this order): a module
# imports only from its own floor or below (names of types under ``if TYPE_CHECKING:`` aside:
# they are never imported when it runs); within a floor, never in a circle.
LAYERS = module_map.FLOORS
FLOOR = {room: floor for floor, rooms in enumerate(LAYERS) for room in rooms}
MAX_CLASS_LINES = 250
MAX_MODULE_LINES = 500


def _room(path_or_module: str) -> str:
    """The first name under ``imgtrainer`` of a file path or a dotted module name."""
    parts = path_or_module.replace("/", ".").removesuffix(".py").split(".")
    name = parts[parts.index("imgtrainer") + 1]
    return "" if name == "__init__" else name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:``: imports there name types
    for type checkers and never run (an ``else:`` beside them does)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _imported_rooms(tree: ast.Module) -> set[str]:
    rooms = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if node.module == "imgtrainer":
                rooms.update(_room(n) for n in names[1:])
            elif node.module.startswith("imgtrainer."):
                rooms.add(_room(node.module))
        elif isinstance(node, ast.Import):
            rooms.update(_room(a.name) for a in node.names if a.name.startswith("imgtrainer."))
    return rooms - {""}


def test_every_room_has_a_floor():
    package = ROOT / "src" / "imgtrainer"
    rooms = {_room(str(p.relative_to(ROOT / "src"))) for p in package.iterdir()}
    rooms -= {"", "__pycache__"}
    assert rooms == set(FLOOR), f"rooms without a floor: {rooms - set(FLOOR)}"


def test_no_import_runs_from_a_lower_floor_to_a_higher_one():
    bends = []
    for path in sorted((ROOT / "src" / "imgtrainer").rglob("*.py")):
        room = _room(str(path.relative_to(ROOT / "src")))
        if not room:
            continue
        for target in _imported_rooms(_tree(path)):
            if FLOOR[target] > FLOOR[room]:
                bends.append(f"{path.relative_to(ROOT).as_posix()} ({room}) -> {target}")
    assert not bends, "imports from a lower floor up to a higher one:\n" + "\n".join(bends)


def test_the_layer_check_sees_an_import_up():
    tree = ast.parse("from imgtrainer.training.loop import x\nfrom imgtrainer import config\n")
    assert _imported_rooms(tree) == {"training", "config"}


def test_the_layer_check_lets_only_type_checking_imports_up():
    tree = ast.parse(
        "import typing\n"
        "if typing.TYPE_CHECKING:\n    from imgtrainer.training.step import RunParts\n"
        "else:\n    from imgtrainer.models import build_model\n"
        "if TYPE_CHECKING:\n    import imgtrainer.tools.predict\n"
        "if DEBUG:\n    from imgtrainer.run import train\n"
        "def f():\n    from imgtrainer.training import loop\n"
    )
    assert _imported_rooms(tree) == {"models", "run", "training"}


def test_no_class_or_module_is_too_long():
    long = []
    for path in _product_files():
        tree = _tree(path)
        where = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            long.append(f"{where} ({lines} lines)")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    long.append(f"{where}:{node.name} ({size} lines)")
    assert not long, (
        f"classes over {MAX_CLASS_LINES} lines or modules over {MAX_MODULE_LINES}:\n"
        + "\n".join(long)
    )


# ----------------------------------------------------------------------------- imports, by module


PACKAGE = ROOT / "src" / "imgtrainer"


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT / "src").with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_of(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _entrance_homes() -> dict[str, str]:
    """The module of each name ``imgtrainer.data`` exports (it imports them on first use)."""
    import imgtrainer.data

    return {name: f"imgtrainer.data.{home}" for name, home in imgtrainer.data._HOME.items()}


def _imports(tree: ast.Module, modules: dict[str, Path]) -> set[str]:
    """The package's modules a module imports, at its top or inside a function: a name from a
    package is its submodule where it is one, its home where the data entrance exports it."""
    homes = _entrance_homes()
    found = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif node.module == "imgtrainer.data" and alias.name in homes:
                    found.add(homes[alias.name])
                else:
                    found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(_tree(path), modules) - {name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one
    module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_even_inside_a_function():
    cycles = _cycles(_import_graph())
    assert not cycles, "modules that import each other in a circle:\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_the_cycle_check_sees_a_function_local_import():
    modules = {"imgtrainer.a": Path("a.py"), "imgtrainer.b": Path("b.py")}
    graph = {
        "imgtrainer.a": _imports(ast.parse("from imgtrainer.b import x\n"), modules),
        "imgtrainer.b": _imports(ast.parse("def f():\n    from imgtrainer.a import y\n"), modules),
    }
    assert _cycles(graph) == [["imgtrainer.a", "imgtrainer.b"]]


# The floors of data/, in the order the bytes travel: storage to a table, one sample in a
# loader worker, a batch on the device, then the top (the loaders, the plan, the checks).
DATA_FLOORS = module_map.DATA_FLOORS


def _data_floor(module: str) -> int:
    inner = module.removeprefix("imgtrainer.data").lstrip(".").split(".")[0]
    return DATA_FLOORS.index(inner if inner in DATA_FLOORS else "")


def test_the_data_floors_import_only_downwards_and_only_the_top_reads_the_config():
    bends, config = [], []
    for module, targets in _import_graph().items():
        if not module.startswith("imgtrainer.data."):
            continue
        for target in targets:
            if target.startswith("imgtrainer.data.") and _data_floor(target) > _data_floor(module):
                bends.append(f"{module} -> {target}")
            if (
                target.startswith("imgtrainer.config")
                and _data_floor(module) < len(DATA_FLOORS) - 1
            ):
                config.append(module)
    assert not bends, "data floors importing a floor above:\n" + "\n".join(sorted(bends))
    assert not config, "data floors that read the config (only the top may):\n" + "\n".join(config)


def test_other_rooms_enter_data_by_its_entrance():
    """Outside ``data`` the package imports ``imgtrainer.data`` only, never an inner module
    (``tools``, the user's tools over the data floors, aside); inside, nothing imports the
    entrance (its names would hide a circle)."""
    homes = _entrance_homes()
    strays = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_of(path)
        inside = module.startswith("imgtrainer.data")
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            tools = module.startswith("imgtrainer.tools")
            if not inside and not tools and node.module.startswith("imgtrainer.data."):
                strays.append(f"{module} imports {node.module}")
            if inside and node.module == "imgtrainer.data":
                strays.append(f"{module} imports the entrance")
    assert not strays, "\n".join(strays)
    assert homes and all(name in dir(importlib.import_module(home)) for name, home in homes.items())


def _type_checking_mirror() -> dict[str, str]:
    """The module each name of the entrance's ``if TYPE_CHECKING:`` block is imported from."""
    tree = _tree(PACKAGE / "data" / "__init__.py")
    block = next(n for n in tree.body if isinstance(n, ast.If) and _is_type_checking(n.test))
    return {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_static_readers_see_the_entrance_names_where_they_live():
    """The data entrance hands its names out on first use; its ``TYPE_CHECKING`` block imports
    the same names from the same modules, so type checkers and go-to-definition follow them."""
    assert _type_checking_mirror() == _entrance_homes()


def test_every_entrance_name_serves_another_room():
    """The door keeps only what other rooms (``tools`` aside, which may go in) import from it."""
    used = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_of(path)
        if module.startswith(("imgtrainer.data", "imgtrainer.tools")):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module == "imgtrainer.data":
                used.update(alias.name for alias in node.names)
    assert set(_entrance_homes()) == used
