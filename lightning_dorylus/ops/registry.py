"""Tensor ops from the user's own modules: registered here, shipped to executors by module NAME.

A user op module holds numpy functions, declares each op once as an ``OpSpec`` and calls
``register_ops({...})`` at import, like the built-in ``vertex.py``/``gat.py``/``sage.py``::

    # my_ops.py: standard library, numpy and lightning_dorylus.ops only (it runs inside executors)
    from lightning_dorylus.ops import OpSpec, register_ops
    register_ops({"my.op.forward": OpSpec(...), "my.op.backward": OpSpec(...)})

Importing it in the graph server makes the ops usable by layers (and the inline executor). Executors run in
other processes, so they import the same module by name at start: the local pool copies every module that
registered ops (:func:`op_modules`) into its handler bundle; ``python -m lightning_dorylus.deploy
--op-module my_ops`` puts it into the Lambda zip. The bundle's ``shipped.py`` lists the names and the worker
and the Lambda entry point import them (:func:`import_op_modules`). Functions never travel pickled.
Standard library only (this module ships to executors too).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Mapping

from . import handlers
from .spec import OpSpec

#: The ops built into the handler (every executor has them).
BUILTIN_OPS = frozenset(handlers.OPS)
_OP_MODULE: dict[str, str] = {}  # user op name -> the module that registered it (what an executor imports)


def register_ops(ops: Mapping[str, OpSpec]) -> None:
    """Adds ``ops`` (name -> ``OpSpec``) to this process's op table; call it at the top of an op module.

    The module that calls this is what executors import to get the ops, so call it at the top level of the
    op module (its functions may live there or in modules it imports, checked when a bundle is built).
    Registering the same op again from the same module (a re-import) replaces it.

    Raises:
        TypeError: a name that is not a non-empty str, or a value that is not an ``OpSpec``.
        ValueError: a built-in op's name; a name another module registered; a forward op whose ``backward``
            is neither registered nor in ``ops``; an op defined in ``__main__`` (executors cannot import it).
    """
    caller = sys._getframe(1).f_globals.get("__name__", "?")
    modules: dict[str, str] = {}
    for name, spec in ops.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"register_ops: op names must be non-empty str, got {name!r}")
        if not isinstance(spec, OpSpec):
            raise TypeError(f"register_ops: op {name!r} must map to a lightning_dorylus.ops.OpSpec, "
                            f"got {type(spec).__name__}")
        if name in BUILTIN_OPS:
            raise ValueError(f"op {name!r} is built into the handler; give your op a name of its own "
                             f"(e.g. 'mymodel.{name}')")
        module = caller
        if "__main__" in (caller, getattr(spec.fn, "__module__", None)):
            raise ValueError(f"op {name!r} is defined in __main__ (the script being run): executors import "
                             "an op's module by name, so define the op in a module of its own (e.g. my_ops.py"
                              " beside the script) and import it from the script")
        if _OP_MODULE.get(name, module) != module:
            raise ValueError(f"op {name!r} is already registered by module {_OP_MODULE[name]!r} "
                             f"(now from {module!r}): op names must be unique")
        modules[name] = module
    for name, spec in ops.items():
        if spec.backward is not None and spec.backward not in ops and spec.backward not in handlers.OPS:
            raise ValueError(f"op {name!r} names backward={spec.backward!r}, which is not registered: "
                             "register the forward and backward ops in one register_ops call")
    handlers.OPS.update(ops)
    _OP_MODULE.update(modules)


def op_modules() -> tuple[str, ...]:
    """Names of the modules whose ops were registered in this process (what an executor must import)."""
    return tuple(sorted(set(_OP_MODULE.values())))


def import_op_modules(names: Iterable[str]) -> None:
    """Imports each named op module (its ``register_ops`` calls run); an executor does this at start."""
    for name in names:
        importlib.import_module(name)
