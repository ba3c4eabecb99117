"""The package list for setuptools: `triode` is src/, and every folder under src/ is a
subpackage of it (src/engine/worker is triode.engine.worker; the data folders
src/kernels/csrc and src/engine/chat_templates are namespace packages, so that their files
install as the package data pyproject.toml names). pyproject.toml holds the rest."""

from setuptools import find_namespace_packages, setup

setup(packages=["triode", *(f"triode.{name}" for name in find_namespace_packages("src", exclude=["*__pycache__*"]))])
