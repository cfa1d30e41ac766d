"""A real package: every public name documented and in the API reference, and the
metadata a package index shows.

Public names are ``numcoll.__all__`` and ``numcoll.torch.__all__``. A function, class
(and its public methods) or module needs a docstring; a data name (a dtype, a constant, a
namespace object) needs a ``#:`` comment right above its assignment in the module that
exports it, which is where Sphinx's autodoc reads it. Every public name also has a place
on one of the API reference's pages (``docs/api/*.md``), and every tunable of
``numcoll.config.Config`` a row in the configuration guide."""

import importlib
import inspect
import pathlib
import re
import tomllib

import pytest

import numcoll as nc

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _modules():
    """(module, its source file) for each module whose ``__all__`` is public."""
    yield nc, ROOT / "numcoll" / "__init__.py"
    try:
        torch_backend = importlib.import_module("numcoll.torch")
    except ImportError:  # torch not installed: numcoll.torch cannot be imported either
        return
    yield torch_backend, ROOT / "numcoll" / "torch" / "__init__.py"


def _is_data(obj) -> bool:
    return not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj)
                or inspect.isbuiltin(obj))


def _public_names():
    for module, _ in _modules():
        for name in module.__all__:
            yield module, name, getattr(module, name)


def _public_objects():
    for module, name, obj in _public_names():
        if _is_data(obj):
            continue
        qualified = f"{module.__name__}.{name}"
        yield qualified, obj
        if inspect.isclass(obj) and obj.__module__.startswith("numcoll"):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and inspect.isfunction(member):
                    yield f"{qualified}.{attr}", getattr(obj, attr, member)


def _comment_documented(source: pathlib.Path, name: str) -> bool:
    """Whether ``name`` is assigned at module level in ``source`` with a ``#:`` comment
    right above it (Sphinx's form for documenting data)."""
    pattern = re.compile(rf"^#:[^\n]*\S[^\n]*\n(?:#:[^\n]*\n)*{re.escape(name)}\s*(?::[^=\n]*)?=",
                         re.M)
    return bool(pattern.search(source.read_text()))


def test_every_public_function_class_and_method_has_a_docstring():
    undocumented = [name for name, obj in _public_objects()
                    if not (inspect.getdoc(obj) or "").strip()]
    assert not undocumented, f"no docstring: {undocumented}"


def test_every_public_data_name_has_a_doc_comment():
    undocumented = [f"{module.__name__}.{name}" for module, source in _modules()
                    for name in module.__all__
                    if _is_data(getattr(module, name)) and not _comment_documented(source, name)]
    assert not undocumented, (f"no '#:' comment above the assignment in the exporting module: "
                              f"{undocumented}")


def test_a_data_name_without_a_comment_is_caught(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("#: documented\nA = 1\nB = 2\n#:\nC = 3\n")
    assert _comment_documented(source, "A")
    assert not _comment_documented(source, "B") and not _comment_documented(source, "C")


def _api_targets() -> set[str]:
    """Every name an autodoc directive of docs/api/*.md documents, fully qualified."""
    targets = set()
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        current = ""
        for line in page.read_text().splitlines():
            m = re.match(r"\s*\.\. (currentmodule|auto\w+):: (\S+)", line)
            if not m:
                continue
            kind, target = m.groups()
            if kind == "currentmodule":
                current = target
            elif kind == "automodule":
                targets.add(target)
            else:
                targets.add(target if target.startswith("numcoll") and "." in target
                            and not current else f"{current}.{target}" if current else target)
    return targets


def test_every_public_name_has_a_place_in_the_api_reference():
    targets = _api_targets()
    missing = []
    for module, name, obj in _public_names():
        qualified = f"{module.__name__}.{name}"
        if inspect.ismodule(obj):
            ok = obj.__name__ in targets or qualified in targets
        else:
            ok = qualified in targets
        if not ok:
            missing.append(qualified)
    assert not missing, f"not in docs/api/*.md: {missing}"


def test_every_tunable_has_a_row_in_the_configuration_guide():
    import dataclasses

    from numcoll.config import Config

    guide = (ROOT / "docs" / "guide" / "configuration.md").read_text()
    missing = [f"NUMCOLL_{f.name.upper()}" for f in dataclasses.fields(Config)
               if f"`NUMCOLL_{f.name.upper()}`" not in guide]
    assert not missing, f"not in docs/guide/configuration.md: {missing}"


def test_package_metadata():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for field in ("license", "authors", "classifiers", "urls", "requires-python", "readme"):
        assert meta.get(field), field
    assert meta["dynamic"] == ["version"] and "version" not in meta
    assert {"torch", "notebook", "bench", "docs"} <= set(meta["optional-dependencies"])
    assert meta["scripts"]["numcoll"] == "numcoll.__main__:main"
    assert (ROOT / "LICENSE").is_file() and (ROOT / "numcoll" / "py.typed").is_file()
    version = nc.__version__
    assert version.count(".") >= 2
    assert f'__version__ = "{version}"' in (ROOT / "numcoll" / "_version.py").read_text()
