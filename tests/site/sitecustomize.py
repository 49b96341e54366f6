"""Processes the tests launch skip the interpreter's final full garbage collections.

tests/conftest.py puts this folder on ``PYTHONPATH``, so every Python process a test starts (and the
workers those start) imports this module at start-up. At exit CPython runs full collections over every
object still alive: after ``import lightning`` that is millions of objects and 1.2-3 CPU-seconds per
process, and the suite starts ~150 processes on 2 cores. Freezing the heap in the last exit handler
(registered first, so it runs after every other one) moves those objects to the permanent generation,
which the final collections skip. Objects are still released by reference counting; only garbage in
reference cycles is left to the OS, which frees the whole process anyway. The product itself does not
do this: a user's process exits as Python's does.
"""

import atexit
import gc

atexit.register(gc.freeze)
