"""A safe install: Lightning 2.6.2 and 2.6.3 on PyPI ran credential-stealing code on import
(GHSA-w37p-236h-pfx3). They must not be installed, pyproject.toml must refuse them, and constraints.txt (the
exact versions scripts/setup.sh installs) must hold what is installed."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
EXCLUDED = {"lightning": ("2.6.2", "2.6.3"), "pytorch-lightning": ("2.6.2", "2.6.3")}


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def requirements(extras: bool = False) -> dict[str, Requirement]:
    """pyproject.toml's dependencies by name (and its optional ones with ``extras``)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the suite's is 3.11: constraints.txt)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    if extras:
        lines += [line for group in project["optional-dependencies"].values() for line in group]
    return {canonicalize_name(req.name): req for req in map(Requirement, lines)}


def constraints() -> dict[str, str]:
    pins = {}
    for number, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"constraints.txt:{number}: expected 'name==version', got {line!r}"
        pins[canonicalize_name(name)] = version
    return pins


@pytest.mark.parametrize("name", sorted(EXCLUDED))
def test_no_excluded_lightning_is_installed(name: str) -> None:
    version = installed(name)
    assert version is None or Version(version).public not in EXCLUDED[name], (
        f"{name} {version} is installed: a malicious release (GHSA-w37p-236h-pfx3). Remove the environment, "
        "treat the machine's credentials as stolen, and reinstall with `make setup`."
    )


@pytest.mark.parametrize("name", sorted(EXCLUDED))
def test_pyproject_refuses_the_excluded_releases(name: str) -> None:
    requirement = requirements().get(name)
    assert requirement is not None, f"pyproject.toml's dependencies do not constrain {name}"
    for bad in EXCLUDED[name]:
        assert not requirement.specifier.contains(bad, prereleases=True), f"{requirement} admits {name} {bad}"
    for good in ("2.6.1", "2.6.4", "2.6.6"):
        assert requirement.specifier.contains(good), f"{requirement} refuses {name} {good}"


def test_constraints_satisfy_pyproject_and_exclude_the_malicious_releases() -> None:
    pins = constraints()
    for name, requirement in requirements(extras=True).items():
        assert name in pins, f"constraints.txt has no line for {name} (run scripts/refresh-constraints.sh)"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, which pyproject.toml's {requirement} refuses"
        )
    for name, bad in EXCLUDED.items():
        assert pins.get(name) not in bad


def test_installed_versions_are_the_constrained_ones() -> None:
    """scripts/setup.sh installs through constraints.txt: a difference means the file is stale (refresh it
    after a deliberate upgrade) or the environment was changed by hand (re-run ``make setup``)."""
    differ = {
        name: (pin, version)
        for name, pin in constraints().items()
        if (version := installed(name)) is not None and Version(version).public != Version(pin).public
    }
    assert not differ, f"installed versions differ from constraints.txt (pin, installed): {differ}"
