"""Unit tests: how triode installs. It owns one top-level import name, ``triode``, which no other
installed distribution provides and which resolves to this repository's files; the wheel holds
nothing else; every module imports; the old names ``engine`` and ``frontend`` are gone; Hugging
Face's ``kernels`` package (a dependency of transformers) lives beside ``triode.kernels``; and
``scripts/check_lock.py`` tells a lock that disagrees with pyproject.toml to be rewritten."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import pkgutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import triode

ROOT = Path(__file__).resolve().parents[1]


def _top_level_names(distribution: importlib.metadata.Distribution) -> set[str]:
    """The top-level import names a distribution installs, from its RECORD (or top_level.txt)."""
    names = set()
    for file in distribution.files or ():
        first = file.parts[0]
        if first.endswith((".dist-info", ".egg-info", ".data")) or first in ("..", "__pycache__"):
            continue
        names.add(first.removesuffix(".py") if len(file.parts) == 1 else first)
    listed = distribution.read_text("top_level.txt")
    return names | set((listed or "").split())


def test_no_other_distribution_provides_triode():
    distributions = list(importlib.metadata.distributions())
    assert len(distributions) > 20  # the whole locked environment, not an empty listing
    owners = sorted({dist.metadata["Name"] for dist in distributions if "triode" in _top_level_names(dist)})
    assert owners in ([], ["triode"]), f"distributions that install a top-level `triode`: {owners}"


@pytest.mark.parametrize(("name", "folder"), [("triode", "src"), ("triode.engine", "src/engine"),
                                              ("triode.frontend", "src/frontend"), ("triode.kernels", "src/kernels")])
def test_packages_resolve_to_this_repository(name, folder):
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve() == ROOT / folder / "__init__.py"


def test_every_module_imports():
    names = [info.name for info in pkgutil.walk_packages(triode.__path__, "triode.")]
    assert len(names) > 150 and "triode.engine.worker.process" in names
    for name in names:
        importlib.import_module(name)


def test_the_public_api_is_vllms_shape():
    assert triode.AsyncLLMEngine is triode.AsyncLLM
    for name in triode.__all__:
        assert getattr(triode, name) is not None
    with pytest.raises(AttributeError, match="module 'triode' has no attribute 'Nothing'"):
        triode.Nothing  # noqa: B018


def test_old_names_are_gone_and_hugging_faces_kernels_is_theirs(tmp_path):
    """Outside the repository, ``engine`` and ``frontend`` do not import (the intended break),
    and ``import kernels`` is Hugging Face's package, not ours, beside ``triode.kernels``."""
    code = (
        "import importlib.util, kernels, triode.kernels\n"
        "print(importlib.util.find_spec('engine'), importlib.util.find_spec('frontend'))\n"
        "print(kernels.__file__)\n"
        "print(triode.kernels.__file__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=True)
    lines = done.stdout.splitlines()
    assert len(lines) == 3
    assert lines[0] == "None None"
    assert Path(lines[1]).resolve().is_relative_to(Path(importlib.metadata.distribution("kernels").locate_file("")))
    assert not Path(lines[1]).resolve().is_relative_to(ROOT / "src")
    assert Path(lines[2]).resolve() == ROOT / "src" / "kernels" / "__init__.py"


def test_the_wheel_installs_only_triode(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("triode-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"triode", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert "triode/kernels/csrc/quant_linear.c" in names
    assert "triode/engine/worker/process.py" in names
    assert any(name.startswith("triode/engine/chat_templates/") for name in names)


def _check_lock(tmp_path: Path, dependencies: list[str], pins: list[str]) -> subprocess.CompletedProcess:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text("[build-system]\nrequires = [\"setuptools>=77\"]\n[project]\n"
                         f"dependencies = {json.dumps(dependencies)}\n")
    lock = tmp_path / "requirements.lock"
    lock.write_text("".join(f"{pin}\n    # via something\n" for pin in ["setuptools==80.1", *pins]))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_lock.py"), "--pyproject", str(pyproject),
                           "--lock", str(lock)], capture_output=True, text=True, timeout=60)


def test_check_lock_accepts_a_lock_that_fits(tmp_path):
    done = _check_lock(tmp_path, ["trio>=0.27", "triton>=3.6; platform_system == 'Nowhere'"], ["trio==0.35.0"])
    assert done.returncode == 0, done.stderr


def test_check_lock_names_every_disagreement_and_make_lock(tmp_path):
    done = _check_lock(tmp_path, ["trio>=0.40", "attrs>=24.1"], ["trio==0.35.0"])
    assert done.returncode == 1
    assert "trio: the lock pins 0.35.0, pyproject.toml asks for >=0.40" in done.stderr
    assert "attrs (>=24.1) is not in the lock" in done.stderr
    assert "make lock" in done.stderr


def test_the_repositorys_lock_fits_pyproject():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_lock.py")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
