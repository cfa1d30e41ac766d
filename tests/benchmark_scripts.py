"""The scripts of ``benchmarks/`` as modules, for the tests that run them at
small sizes (they are scripts, not a package: loaded by path)."""

import importlib.util
import pathlib

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    """``benchmarks/<name>.py``, imported as the module ``name``."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
