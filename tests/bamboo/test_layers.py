"""The package's folders are floors (docs/architecture.md, "The package"): a module imports only from its own
floor or the floors below, so each floor can be read, tested and reused without the ones above it; and the
floors under the runtime's processes (the layout and the control plane) import no Lightning, so the
supervisor and the agents start without it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_bamboo"
FLOORS = {  # bottom (0) to top; a top-level module or folder not named here is on the top floor
    "contract": 0, "layout": 0,
    "_lightning": 1,
    "protocol": 2,
    "control": 3,
    "schedule": 4,
    "pipeline": 5,
    "step": 6,
    "checkpoint": 7,
    "runtime": 8,
}
TOP = max(FLOORS.values()) + 1
WITHOUT_LIGHTNING = ("layout", "protocol", "control", "schedule")


def floor(module: str) -> int:
    """``lightning_bamboo.<first>...`` -> the floor of ``<first>`` (a top-level module or a folder)."""
    parts = module.split(".")
    return FLOORS.get(parts[1], TOP) if len(parts) > 1 else TOP


def runtime_imports(path: Path) -> list[str]:
    """The modules ``path`` imports when it runs (imports under ``if TYPE_CHECKING:`` name types only)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for branch in ast.walk(tree)
                   if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
                   for node in ast.walk(branch)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_imports_no_floor_above_its_own(path: Path) -> None:
    name = ".".join(("lightning_bamboo", *path.relative_to(PACKAGE).with_suffix("").parts))
    own = floor(name)
    above = sorted({m for m in runtime_imports(path) if m.startswith("lightning_bamboo.") and floor(m) > own})
    assert not above, f"{name} (floor {own}) imports from floors above it: {above}"


@pytest.mark.parametrize("folder", WITHOUT_LIGHTNING)
def test_the_floors_below_the_runtime_import_no_lightning(folder: str) -> None:
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        lightning = [m for m in runtime_imports(path) if m == "lightning" or m.startswith("lightning.")]
        assert not lightning, f"{path.relative_to(PACKAGE)} imports {lightning}"


def test_every_folder_of_the_package_has_a_floor() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    tools = {"advise", "simulate", "models", "notices"}  # the top floor: commands, example models, notices
    assert folders - tools == set(FLOORS) - {"contract"}


def test_every_strategy_attribute_the_package_reads_by_name_exists() -> None:
    """The ledger, the advisor's probe and the callbacks read the strategy's state with ``getattr(strategy,
    "name", default)`` so they also run under other strategies; a name the strategy stops providing would
    make them fall back silently (the ledger's replica digests and the probe's replica bytes once went empty
    that way). Every such name must exist on a ``BambooStrategy``."""
    from lightning_bamboo import BambooStrategy

    strategy = BambooStrategy(num_stages=2)
    read = set()
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and ast.unparse(node.args[0]).endswith("strategy")
                    and isinstance(node.args[1], ast.Constant)):
                read.add(node.args[1].value)
    assert read, "found no getattr(strategy, ...) in the package"
    missing = sorted(name for name in read if not hasattr(strategy, name))
    assert not missing, f"the package reads BambooStrategy attributes that do not exist: {missing}"


def all_imports(path: Path) -> list[str]:
    """Every module ``path`` names in an import, those under ``if TYPE_CHECKING:`` included; ``from a import
    b`` names ``a.b`` when that is a module of the package, else ``a``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [f"{node.module}.{alias.name}" for alias in node.names]
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def module_name(path: Path) -> str:
    return ".".join(("lightning_bamboo", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
        ".__init__")


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (types included). ``from a import b`` counts as an import
    of ``a.b`` alone when that is a module; a module's own packages are never an edge (Python runs a
    package's ``__init__`` before its modules, whichever imports which)."""
    names = {module_name(p) for p in modules()}
    graph: dict[str, set[str]] = {}
    for path in modules():
        name = module_name(path)
        imported = all_imports(path)
        edges = set()
        for target in imported:
            if target not in names or target == name or name.startswith(f"{target}."):
                continue
            if any(other.startswith(f"{target}.") and other in names for other in imported) and not any(
                    f"{target}.{alias}" not in names for alias in _aliases(path, target)):
                continue  # ``from a import b`` of modules only: the edges are to a.b
            edges.add(target)
        graph[name] = edges
    return graph


def _aliases(path: Path, module: str) -> list[str]:
    """The names ``path`` imports ``from module``."""
    return [alias.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module == module for alias in node.names]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (each found once, as the path that closes it)."""
    found: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                found.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_package_has_no_import_circle() -> None:
    """No module of ``lightning_bamboo`` imports one that imports it back, directly or through others, not
    even for type hints: each can be read and tested from the bottom up (the membership, fallback and joins
    once imported each other; what they share of Lightning is its own module, ``runtime/lightning_side``)."""
    assert cycles(import_graph()) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
