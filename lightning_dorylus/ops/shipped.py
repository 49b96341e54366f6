"""The user op modules a handler bundle carries, imported by the worker and the Lambda entry at start.

``bundle.write_bundle`` / ``write_zip`` replace this file in the bundle with the names they copied
(``registry.op_modules()`` for the local pool, ``deploy --op-module`` for Lambda). The package's own copy
lists none.
"""

OP_MODULES: tuple[str, ...] = ()
