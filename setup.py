# The cffi extension needs setup.py's cffi_modules; all metadata is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["native/build_engine.py:ffibuilder"])
