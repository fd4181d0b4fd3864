"""A test module's optional dependency, imported when a test first uses it.

Every pytest-xdist worker collects (imports) every test module; a package imported
at a module's top (MLflow, wandb, transformers: up to a second and a half each) is then
imported by every worker, also by those that never run a test of that module.
"""

from __future__ import annotations

import importlib
import importlib.util
import types

import pytest


class _OnFirstUse(types.ModuleType):
    """Stands for a module; the first read of a public attribute imports it.

    Private and special names (pytest's collection probes module-level objects
    for ``_mock_name``, ``__test__``, ...) are not the module's: they do not import
    it.
    """

    def __getattr__(self, attribute: str):
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self.__name__), attribute)


def module_or_skip(name: str, reason: str) -> types.ModuleType:
    """``name``, imported on first use, or skip the calling test module where it
    is not installed (call at a test module's top, as ``pytest.importorskip``).

    Unlike ``pytest.importorskip``, an installed package that fails to import fails
    the tests that use it, with its own error, instead of skipping them.
    """
    if importlib.util.find_spec(name) is None:
        pytest.skip(reason, allow_module_level=True)
    return _OnFirstUse(name)
