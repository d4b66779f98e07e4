"""The wheel holds the whole package: every module of cachecompile/ and of store/ (installed
as cachecompile.store), the py.typed markers, the license, and the version from
cachecompile/_version.py.

pyproject.toml lists the packages by hand: setuptools' package finder cannot see store/ under
its installed name (package-dir maps it; find names folders by their path). A new
subpackage missing from that list would install without it, and only an installed user
would notice; this test builds the wheel and notices first."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What the build reads: the two source trees and the files pyproject.toml names.
SOURCES = ("cachecompile", "store", "pyproject.toml", "README.md", "LICENSE")


def _setuptools_major() -> int:
    try:
        return int(version("setuptools").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 0


def expected_files() -> set[str]:
    """Every .py file and py.typed marker of the checkout, by its path in the wheel."""
    found = set()
    for root, installed in (("cachecompile", "cachecompile"), ("store", "cachecompile/store")):
        for path in (REPO / root).rglob("*"):
            if path.is_file() and (path.suffix == ".py" or path.name == "py.typed") \
                    and "__pycache__" not in path.parts:
                found.add(f"{installed}/{path.relative_to(REPO / root).as_posix()}")
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    # The build runs on a copy, so that it writes no build/ or egg-info into the checkout.
    # No build isolation: the venv's setuptools (torch requires >= 77.0.3, as the build
    # does) builds it without reaching an index.
    if _setuptools_major() < 77:
        pytest.skip("setuptools >= 77 is not installed here (pyproject's build requirement)")
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (built,) = out.glob("cachecompile-*.whl")
    return zipfile.ZipFile(built)


def test_every_package_and_module_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    packages = {f.rsplit("/", 1)[0] for f in expected_files() if f.endswith("/__init__.py")}
    assert "cachecompile/store/remote" in packages
    missing_packages = sorted(p.replace("/", ".") for p in packages
                              if f"{p}/__init__.py" not in names)
    assert not missing_packages, (
        f"packages missing from the wheel: {missing_packages}; add them to "
        "[tool.setuptools] packages in pyproject.toml")
    missing = sorted(expected_files() - names)
    assert not missing, f"files missing from the wheel: {missing}"
    assert {"cachecompile/py.typed", "cachecompile/store/py.typed"} <= names
    # Nothing installs as a top-level ``store`` (or anything else but cachecompile).
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"cachecompile"}, tops


def test_the_wheel_carries_the_license_and_the_one_version(wheel: zipfile.ZipFile) -> None:
    from cachecompile._version import __version__

    dist_info = f"cachecompile-{__version__}.dist-info"
    assert (wheel.read(f"{dist_info}/licenses/LICENSE")
            == (REPO / "LICENSE").read_bytes())
    metadata = wheel.read(f"{dist_info}/METADATA").decode()
    assert f"\nVersion: {__version__}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata
    # What an index shows and filters by (issue 51): the Pythons CI runs, typed, Linux.
    for classifier in ("Programming Language :: Python :: 3.10",
                       "Programming Language :: Python :: 3.12", "Typing :: Typed",
                       "Operating System :: POSIX :: Linux"):
        assert f"\nClassifier: {classifier}\n" in metadata, classifier
    assert "\nKeywords: " in metadata
