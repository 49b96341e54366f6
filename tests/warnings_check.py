"""Find Python warnings in a command's output (both the standard format and Lightning's shorter one)."""

from __future__ import annotations

import re

# "path/to/file.py:123: SomeWarning: message" (warnings.formatwarning) or "path/to/file.py:123: message"
# (Lightning's rank_zero_warn format), and any "...Warning:" category prefix
WARNING_LINE = re.compile(r"\.py:\d+: |\b[A-Z][A-Za-z]*Warning\b")


def warning_lines(output: str) -> list[str]:
    """The lines of ``output`` that look like a printed Python warning."""
    return [line for line in output.splitlines() if WARNING_LINE.search(line)]
