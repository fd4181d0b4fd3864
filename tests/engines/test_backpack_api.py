"""The BackPACK engine relies on a few BackPACK internals; this says which broke."""

import pytest

from cockpit.engines.backpack import api as engine


def test_installed_backpack_provides_what_the_engine_relies_on():
    problems = engine.check_backpack_api()
    assert not problems, (
        "The installed BackPACK changed what cockpit/engines/backpack/api.py and "
        "backpack_rules.py rely on:\n  "
        + "\n  ".join(problems)
        + "\nFix: adapt those two modules (and REQUIRED_API) to this BackPACK, or "
        "install a BackPACK version the engine supports."
    )


@pytest.mark.parametrize(
    "entry",
    [
        ("backpack.extensions", "NoSuchExtension"),
        ("backpack.no_such_module", "anything"),
        ("backpack.extensions", "BatchGrad().savefield == 'renamed'"),
    ],
)
def test_the_check_reports_a_missing_piece(monkeypatch, entry):
    monkeypatch.setattr(engine, "REQUIRED_API", (entry,))
    problems = engine.check_backpack_api()
    assert len(problems) == 1 and entry[1] in problems[0]


def test_no_other_module_names_backpack_internals():
    """Only the engine modules import BackPACK beyond its documented entry points."""
    import pathlib
    import re

    root = pathlib.Path(engine.__file__).parents[2]
    # and the 1.0.2 adapters' _fetch_batch_grad, which reads BatchGrad's savefield
    # as 1.0.2 did (quantities may not import the engines)
    allowed = {
        "engines/backpack/api.py",
        "engines/backpack/rules.py",
        "quantities/compat.py",
    }
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        if rel in allowed:
            continue
        for pattern in (r"\bgrad_batch\b", r"^\s*(?:from|import) backpack\b"):
            for line in re.findall(f".*{pattern}.*", text, flags=re.M):
                if line.strip() != "from backpack import extend":  # public API
                    offenders.append(f"{rel}: {line.strip()}")
    assert not offenders, offenders
