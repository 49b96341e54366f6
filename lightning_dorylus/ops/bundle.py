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
        │   └── bundle.py  gat.py  handlers.py  lambda_entry.py  vertex.py
        └── executors/
            ├── __init__.py         (stub)
            └── worker.py

The local worker pool runs ``python -S -m lightning_dorylus.executors.worker`` with the bundle as its
working directory and ``PYTHONPATH`` = a directory made by ``link_numpy`` (``-S``: no site-packages;
so the worker can import the standard library, numpy and the bundle, and nothing else, as in
Lambda); ``write_zip`` zips the same tree as the Lambda deployment package, whose handler is
``LAMBDA_HANDLER`` (``lambda_handler(event, context)`` in ``ops/lambda_entry.py``; see
``python -m lightning_dorylus.deploy``).
"""

from __future__ import annotations

import ast
import shutil
import sys
import zipfile
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


def write_bundle(root: str | Path) -> Path:
    """Copy the bundle under ``root`` (created if missing) and return ``root``."""
    root = Path(root)
    for rel in bundle_files():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PACKAGE_DIR.parent / rel, root / rel)
    for name, text in STUB_INITS.items():
        (root / name).write_text(text)
    return root


def write_zip(path: str | Path) -> Path:
    """Write the bundle as a zip (a Lambda deployment package, with numpy from a layer).

    Entries get a fixed timestamp and mode, so the same sources give the same bytes (and the same
    ``CodeSha256`` on AWS: an unchanged bundle is not redeployed).
    """
    path = Path(path)
    entries = [(rel.as_posix(), (PACKAGE_DIR.parent / rel).read_bytes()) for rel in bundle_files()]
    entries += [(name, text.encode()) for name, text in STUB_INITS.items()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in sorted(entries):
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
    result: dict[str, set[str]] = {}
    for rel in bundle_files():
        parts = list(rel.parent.parts)
        names: set[str] = set()
        for node in ast.walk(ast.parse((PACKAGE_DIR.parent / rel).read_text(), str(rel))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = parts[: len(parts) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                names.add(module)
                names.update(f"{module}.{alias.name}" for alias in node.names)
        result[rel.as_posix()] = names
    return result


def _own_module(name: str) -> str | None:
    """The module of this repository that ``name`` refers to (``a.b.attr`` -> ``a.b``), or None."""
    parts = name.split(".")
    while parts:
        path = PACKAGE_DIR.parent.joinpath(*parts)
        if path.with_suffix(".py").is_file() or path.is_dir():
            return ".".join(parts)
        parts.pop()
    return None


def check_imports() -> None:
    """Raise if a bundled file imports anything but the standard library, numpy, or bundled modules."""
    bundled = {".".join(rel.with_suffix("").parts) for rel in bundle_files()}
    bundled |= {".".join(rel.parent.parts) for rel in bundle_files()}  # the packages themselves
    bad: dict[str, list[str]] = {}
    for path, names in imported_modules().items():
        for name in sorted(names):
            root = name.split(".")[0]
            if root == PACKAGE_DIR.name:
                ok = _own_module(name) in bundled
            else:
                ok = root in sys.stdlib_module_names or root == "numpy"
            if not ok:
                bad.setdefault(path, []).append(name)
    if bad:
        raise ImportError(f"handler bundle files import modules that will not exist in an executor: {bad}")
