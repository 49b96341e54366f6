#!/usr/bin/env bash
# Regenerate constraints.txt from .venv: the exact version of every installed package (the project itself,
# installed editable, excluded). scripts/setup.sh installs through it, so a fresh setup gets what the suite
# was last run with. Run after a deliberate upgrade, then `make setup` and the tests, and commit the file.
#
# A local version label (torch's "+cpu") is dropped: pip matches torch==X against X+cpu as well, and which
# build of torch is installed is decided by setup.sh's TORCH_PIN and the wheel source, not by this file.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "refresh-constraints: no $VENV; run 'make setup' first" >&2
    exit 2
fi
torch_pin=$(sed -n 's/^TORCH_PIN="\(.*\)"$/\1/p' scripts/setup.sh)
python_version=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
{
    echo "# Exact versions the test suite was run with (Python $python_version); used by scripts/setup.sh"
    echo "# (pip install -c constraints.txt). Regenerate with scripts/refresh-constraints.sh from .venv."
    "$VENV/bin/python" -m pip --disable-pip-version-check freeze --exclude-editable \
        | grep -v '^-e ' | sed -E 's/^([A-Za-z0-9._-]+==[^+; ]+)\+[A-Za-z0-9.]+/\1/'
} > constraints.txt.new
if grep -Eiq '^(lightning|pytorch-lightning)==2\.6\.[23]$' constraints.txt.new; then
    echo "refresh-constraints: .venv has a malicious Lightning release (GHSA-w37p-236h-pfx3); not written" >&2
    rm -f constraints.txt.new
    exit 1
fi
if ! grep -qx "$torch_pin" constraints.txt.new; then
    echo "refresh-constraints: .venv's torch is not setup.sh's TORCH_PIN ($torch_pin); not written" >&2
    rm -f constraints.txt.new
    exit 1
fi
mv constraints.txt.new constraints.txt
echo "refresh-constraints: wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
