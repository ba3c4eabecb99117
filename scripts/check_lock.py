"""Checks that requirements.lock satisfies pyproject.toml: every requirement of triode (its
dependencies, the `bench` and `test` extras and the build backend) is pinned in the lock, at a version its range
admits. `make setup` and `make test` run it; a lock that disagrees means pyproject.toml changed
without `make lock`. With --compare-installed it lists instead the packages that this interpreter
has at other versions than the lock (`make test-latest` prints that).

    python scripts/check_lock.py [--pyproject pyproject.toml] [--lock requirements.lock]
    python scripts/check_lock.py --compare-installed
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCKED_EXTRAS = ("bench", "test")  # the Makefile's `make lock` compiles these in


def requirements(pyproject: Path) -> list[Requirement]:
    """What triode asks for: its dependencies, the extras the lock holds and the build system."""
    config = tomllib.loads(pyproject.read_text())
    extras = config["project"].get("optional-dependencies", {})
    lines = [*config["project"]["dependencies"],
             *(line for extra in LOCKED_EXTRAS for line in extras.get(extra, [])),
             *config["build-system"]["requires"]]
    return [Requirement(line) for line in lines]


def pins(lock: Path) -> dict[str, Version]:
    """The lock's `name==version` lines (pip-compile's output), by canonical name."""
    pinned = {}
    for line in lock.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        pinned[canonicalize_name(requirement.name)] = Version(specifier.version)
    return pinned


def disagreements(pyproject: Path, lock: Path) -> list[str]:
    pinned = pins(lock)
    problems = []
    for requirement in requirements(pyproject):
        if requirement.marker is not None and not any(
                requirement.marker.evaluate({"extra": extra}) for extra in LOCKED_EXTRAS):
            continue
        version = pinned.get(canonicalize_name(requirement.name))
        if version is None:
            problems.append(f"{requirement.name} ({requirement.specifier or 'any version'}) is not in the lock")
        elif not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement.name}: the lock pins {version}, pyproject.toml asks for "
                            f"{requirement.specifier}")
    return problems


def installed_differences(lock: Path) -> list[str]:
    """`name: locked X, installed Y` for every locked package installed at another version, or not
    at all, and `name: installed Y, not in the lock` for packages the lock lacks."""
    pinned = pins(lock)
    installed = {canonicalize_name(dist.metadata["Name"]): Version(dist.version)
                 for dist in importlib.metadata.distributions()}
    lines = []
    for name in sorted((pinned.keys() | installed.keys()) - {"triode", "pip"}):
        locked, present = pinned.get(name), installed.get(name)
        if locked == present:
            continue
        lines.append(f"{name}: locked {locked or '-'}, installed {present or '-'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    parser.add_argument("--lock", type=Path, default=ROOT / "requirements.lock")
    parser.add_argument("--compare-installed", action="store_true",
                        help="list the installed versions that differ from the lock")
    args = parser.parse_args(argv)
    if args.compare_installed:
        differences = installed_differences(args.lock)
        print(f"{len(differences)} packages differ from {args.lock.name}")
        for line in differences:
            print(f"  {line}")
        return 0
    problems = disagreements(args.pyproject, args.lock)
    if problems:
        print(f"{args.lock.name} disagrees with {args.pyproject.name}:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        print("Run `make lock` to rewrite the lock, and commit it saying what moved.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
