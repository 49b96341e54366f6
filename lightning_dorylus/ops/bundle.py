"""The handler bundle: the exact files that run inside an executor, outside the full package.

A Lambda zip cannot hold torch, and ``lightning_dorylus/__init__.py`` imports torch and Lightning. So
executors run a *bundle*: ``lightning_dorylus/wire.py``, ``lightning_dorylus/ops/*.py`` and
``lightning_dorylus/executors/worker.py`` copied with their package paths, with docstring-only stub
``__init__.py`` files instead of the real ones above ``ops/``. So ``from lightning_dorylus.ops import
handlers`` works with only numpy installed, and, being a regular package first on ``sys.path``, the
bundle's ``lightning_dorylus`` wins over an installed one. Layout::

    <root>/
    └── lightning_dorylus/
        ├── __init__.py             (stub)
        ├── wire.py
        ├── ops/
        │   ├── __init__.py
        │   ├── bundle.py  gat.py  handlers.py  lambda_entry.py  registry.py  sage.py  spec.py  vertex.py
        │   └── shipped.py          (written: the names of the user op modules below)
        └── executors/
            ├── __init__.py         (stub)
            └── worker.py
    <user op modules>               e.g. my_ops.py, or my_pkg/__init__.py (stub) + my_pkg/ops.py

User op modules (``registry``: ops registered from the user's own module) are copied by name, their imports
checked (standard library, numpy and ``lightning_dorylus.ops`` only), and listed in ``shipped.py``; the worker
and the Lambda entry point import them before answering requests.

The local worker pool runs ``python -S -m lightning_dorylus.executors.worker`` with the bundle as its
working directory and ``PYTHONPATH`` = a directory made by ``link_numpy`` (``-S``: no site-packages;
so the worker can import the standard library, numpy and the bundle, and nothing else, as in
Lambda); ``write_zip`` zips the same tree as the Lambda deployment package, whose handler is
``LAMBDA_HANDLER`` (``lambda_handler(event, context)`` in ``ops/lambda_entry.py``; see
``python -m lightning_dorylus.deploy``).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # .../lightning_dorylus

#: The Lambda function's handler setting: ``module.function`` inside the zip.
LAMBDA_HANDLER = "lightning_dorylus.ops.lambda_entry.lambda_handler"


def bundle_files() -> list[Path]:
    """Paths relative to the package's parent directory, e.g. ``lightning_dorylus/wire.py``."""
    files = [PACKAGE_DIR / "wire.py", *sorted((PACKAGE_DIR / "ops").glob("*.py")),
             PACKAGE_DIR / "executors" / "worker.py"]
    return [f.relative_to(PACKAGE_DIR.parent) for f in files]


STUB_INITS: dict[str, str] = {
    name: '"""Handler bundle stub: the full package is not shipped to executors (see ops/bundle.py)."""\n'
    for name in ("lightning_dorylus/__init__.py", "lightning_dorylus/executors/__init__.py")
}
SHIPPED = "lightning_dorylus/ops/shipped.py"  # replaced in a bundle by the names of its user op modules


def bundle_entries(op_modules: Sequence[str] = ()) -> dict[str, bytes]:
    """Archive path -> contents of everything a bundle holds: the package files, the stubs, the user op
    modules ``op_modules`` (module names; see :mod:`.registry`) and a ``shipped.py`` listing them.

    Raises:
        ImportError: an op module that cannot be found, is not a plain ``.py`` module, or imports anything
            an executor lacks (only the standard library, numpy, ``lightning_dorylus.ops`` and the other
            shipped op modules exist there).
    """
    entries = {rel.as_posix(): (PACKAGE_DIR.parent / rel).read_bytes() for rel in bundle_files()}
    entries.update({name: text.encode() for name, text in STUB_INITS.items()})
    for name in op_modules:
        path, source = op_module_source(name)
        parts = name.split(".")
        for depth in range(1, len(parts)):  # parent packages: stubs (their real __init__ may import torch)
            entries.setdefault("/".join(parts[:depth]) + "/__init__.py", b'"""Op module package stub."""\n')
        entries[path] = source
    check_op_module_imports(op_modules)
    entries[SHIPPED] = (f'"""User op modules of this bundle (written by ops/bundle.py)."""\n\n'
                        f"OP_MODULES: tuple[str, ...] = {tuple(op_modules)!r}\n").encode()
    return entries


def op_module_source(name: str) -> tuple[str, bytes]:
    """``(archive path, source)`` of op module ``name`` as this interpreter would import it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as err:
        raise ImportError(f"op module {name!r} cannot be found: {err}") from err
    if spec is None:
        raise ImportError(f"op module {name!r} cannot be found from here (sys.path); executors import it by "
                          "this name")
    origin = spec.origin
    if origin is None or not origin.endswith(".py") or spec.submodule_search_locations is not None:
        raise ImportError(f"op module {name!r} must be a plain .py module importable here (found "
                          f"{origin!r}); executors import it by this name")
    return "/".join(name.split(".")) + ".py", Path(origin).read_bytes()


def write_bundle(root: str | Path, op_modules: Sequence[str] = ()) -> Path:
    """Copy the bundle (with the user op modules ``op_modules``) under ``root`` (created if missing)."""
    root = Path(root)
    for name, data in bundle_entries(op_modules).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def write_zip(path: str | Path, op_modules: Sequence[str] = ()) -> Path:
    """Write the bundle (with the user op modules ``op_modules``) as a zip (a Lambda deployment package,
    with numpy from a layer).

    Entries get a fixed timestamp and mode, so the same sources give the same bytes (and the same
    ``CodeSha256`` on AWS: an unchanged bundle is not redeployed).
    """
    path = Path(path)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in sorted(bundle_entries(op_modules).items()):
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return path


def numpy_path() -> str:
    """The directory numpy is installed in (for running a bundle with ``python -S``)."""
    import numpy

    return str(Path(numpy.__file__).resolve().parent.parent)


def link_numpy(site_dir: str | Path) -> Path:
    """Make ``site_dir`` an import path holding only numpy (symlinks to this interpreter's install).

    A worker started with ``python -S`` and ``PYTHONPATH=site_dir`` can then import the standard
    library, numpy and the bundle, and nothing else, as in a Lambda with a numpy layer. Bundled
    shared libraries (``numpy.libs`` in manylinux wheels) are linked too.
    """
    site_dir = Path(site_dir)
    site_dir.mkdir(parents=True, exist_ok=True)
    source = Path(numpy_path())
    for name in ("numpy", "numpy.libs"):
        if (source / name).exists():
            (site_dir / name).symlink_to(source / name, target_is_directory=True)
    return site_dir


def imported_modules() -> dict[str, set[str]]:
    """Every name each bundled file imports (``from a import b`` gives ``a`` and ``a.b``), relative
    imports resolved to absolute names."""
    return {rel.as_posix(): _imports((PACKAGE_DIR.parent / rel).read_text(), list(rel.parent.parts), str(rel))
            for rel in bundle_files()}


def _imports(source: str, package: list[str], filename: str) -> set[str]:
    """The absolute names ``source`` (a module of package ``package``) imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _own_module(name: str) -> str | None:
    """The module of this repository that ``name`` refers to (``a.b.attr`` -> ``a.b``), or None."""
    parts = name.split(".")
    while parts:
        path = PACKAGE_DIR.parent.joinpath(*parts)
        if path.with_suffix(".py").is_file() or path.is_dir():
            return ".".join(parts)
        parts.pop()
    return None


def _bundled_modules() -> set[str]:
    bundled = {".".join(rel.with_suffix("").parts) for rel in bundle_files()}
    return bundled | {".".join(rel.parent.parts) for rel in bundle_files()}  # the packages themselves


def _allowed(name: str, bundled: set[str], extra: Sequence[str] = ()) -> bool:
    root = name.split(".")[0]
    if root == PACKAGE_DIR.name:
        return _own_module(name) in bundled
    if any(name == m or name.startswith(m + ".") or m.startswith(name + ".") for m in extra):
        return True
    return root in sys.stdlib_module_names or root == "numpy"


def check_imports() -> None:
    """Raise if a bundled file imports anything but the standard library, numpy, or bundled modules."""
    bundled = _bundled_modules()
    bad: dict[str, list[str]] = {}
    for path, names in imported_modules().items():
        for name in sorted(names):
            if not _allowed(name, bundled):
                bad.setdefault(path, []).append(name)
    if bad:
        raise ImportError(f"handler bundle files import modules that will not exist in an executor: {bad}")


def check_op_module_imports(op_modules: Sequence[str]) -> None:
    """Raise naming each user op module that imports what an executor lacks (torch, scipy, the rest of
    ``lightning_dorylus``...): executors have the standard library, numpy, ``lightning_dorylus.ops`` and
    the other shipped op modules."""
    bundled = _bundled_modules()
    bad: dict[str, list[str]] = {}
    for name in op_modules:
        path, source = op_module_source(name)
        imports = _imports(source.decode(), name.split(".")[:-1], path)
        bad_names = sorted(n for n in imports if not _allowed(n, bundled, op_modules))
        if bad_names:
            bad[name] = bad_names
    if bad:
        raise ImportError(f"op modules import what an executor does not have (only the standard library, "
                          f"numpy, lightning_dorylus.ops and the shipped op modules): {bad}; move that code "
                          "out of the op module")
