"""A real package: every public function, class and method documented, and
the metadata a package index shows."""

import inspect
import pathlib
import tomllib

import numcoll as nc

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _public_objects():
    for name in nc.__all__:
        obj = getattr(nc, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            yield name, obj
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and inspect.isfunction(member):
                        yield f"{name}.{attr}", getattr(obj, attr, member)


def test_every_public_function_class_and_method_has_a_docstring():
    undocumented = [name for name, obj in _public_objects()
                    if not (inspect.getdoc(obj) or "").strip()]
    assert not undocumented, f"no docstring: {undocumented}"


def test_package_metadata():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for field in ("license", "authors", "classifiers", "urls", "requires-python", "readme"):
        assert meta.get(field), field
    assert meta["dynamic"] == ["version"] and "version" not in meta
    assert {"torch", "notebook", "bench"} <= set(meta["optional-dependencies"])
    assert meta["scripts"]["numcoll"] == "numcoll.__main__:main"
    assert (ROOT / "LICENSE").is_file() and (ROOT / "numcoll" / "py.typed").is_file()
    version = nc.__version__
    assert version.count(".") >= 2
    assert f'__version__ = "{version}"' in (ROOT / "numcoll" / "_version.py").read_text()
