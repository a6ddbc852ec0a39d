"""Packages are found, not listed: every folder with an `__init__.py` under compiler/ (as `mtkc`),
passes/ (as `mtkc.passes`) and opsets/ (as `mtkc.opsets`) reaches the wheel. Metadata is in pyproject.toml."""

from setuptools import find_packages, setup

ROOTS = {"mtkc": "compiler", "mtkc.passes": "passes", "mtkc.opsets": "opsets"}

setup(
    package_dir=ROOTS,
    packages=[f"{name}{'.' + sub if sub else ''}" for name, folder in ROOTS.items()
              for sub in ["", *find_packages(folder)]],
)
