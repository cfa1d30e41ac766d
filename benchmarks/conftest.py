"""Collect the ``bench_*.py`` suites when pytest is given this folder
(``python -m pytest benchmarks``): they are not ``test_*.py``, so the default
pattern would skip them, and they stay out of the default test run."""

import pytest


def pytest_collect_file(file_path, parent):
    # Files named on the command line are collected by pytest itself.
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
