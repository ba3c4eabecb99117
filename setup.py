"""The package list for setuptools: `triode` is src/, and every package under src/ is a
subpackage of it (src/engine/worker is triode.engine.worker). pyproject.toml holds the rest."""

from setuptools import find_packages, setup

setup(packages=["triode", *(f"triode.{name}" for name in find_packages("src"))])
