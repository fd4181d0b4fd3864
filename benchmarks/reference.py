"""Same-run comparison with the reference package (``--reference``).

cockpit-for-pytorch 1.0.2 installs the same top-level package ``cockpit`` as this
checkout, so it runs in its own throwaway virtual environment, outside the
repository. Its children start from a folder that holds only a link to
``benchmarks/`` and run without ``PYTHONPATH``: ``import cockpit`` finds 1.0.2,
``import benchmarks`` this checkout's harness. The environment sees this
interpreter's packages through a path file, so torch, BackPACK and numpy are the very
ones our children use (torch pinned by ``-c constraints.txt`` all the same) and
nothing large is downloaded; pip adds what 1.0.2 needs beyond them (``setuptools<81``
for ``pkg_resources``, seaborn, json-tricks) into the environment, where those copies
come first.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from benchmarks.measure import REPO, Interpreter

#: What ``--reference`` installs by default.
PACKAGE = "cockpit-for-pytorch==1.0.2"
CONSTRAINTS = REPO / "constraints.txt"
_ENV_PYTHON = Path("bin") / "python"
_WHERE = (
    "import cockpit, importlib.metadata as m; "
    "print(cockpit.__file__); print(m.version({!r}))"
)


def _say(text: str) -> None:
    print(f"[reference] {text}", file=sys.stderr, flush=True)


def build(folder: Path, requirement: str = PACKAGE) -> Path:
    """Create (or reuse) a virtual environment in ``folder`` with ``requirement``.

    Returns:
        The environment's Python.
    """
    python = folder / _ENV_PYTHON
    if not python.exists():
        _say(f"creating a virtual environment in {folder}")
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    site = subprocess.run(
        [
            str(python),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    shared = sysconfig.get_paths()["purelib"]
    Path(site, "_benchmarks_shared.pth").write_text(shared + "\n")
    _say(f"installing {requirement} (torch constrained by {CONSTRAINTS.name})")
    command = [str(python), "-m", "pip", "install", "--quiet"]
    if CONSTRAINTS.exists():
        command += ["-c", str(CONSTRAINTS)]
    subprocess.run(command + [requirement, "setuptools<81"], check=True)
    return python


def _check(interpreter: Interpreter, venv: Path, requirement: str) -> str:
    """Make sure the children import the installed package; return its version."""
    name = re.split(r"[<>=!~ \[]", requirement, maxsplit=1)[0]
    proc = subprocess.run(
        [interpreter.python, "-c", _WHERE.format(name)],
        cwd=interpreter.cwd,
        env={k: v for k, v in os.environ.items() if k not in interpreter.drop_env},
        capture_output=True,
        text=True,
        check=True,
    )
    where, version = proc.stdout.split()
    if not Path(where).resolve().is_relative_to(venv.resolve()):
        raise RuntimeError(
            f"the reference children import cockpit from {where}, not from {venv}"
        )
    return version


@contextlib.contextmanager
def interpreter(venv=None, requirement: str = PACKAGE):
    """Yield ``(Interpreter, label)`` for children that run the reference package.

    Args:
        venv: Folder of the environment, kept for the next run; None: a temporary
            one, removed afterwards.
        requirement: What pip installs, e.g. ``cockpit-for-pytorch==1.0.2``.
    """
    with tempfile.TemporaryDirectory(prefix="cockpit-bench-reference-") as scratch:
        folder = Path(venv) if venv else Path(scratch, "venv")
        python = build(folder, requirement)
        start = Path(scratch, "start")
        start.mkdir()
        (start / "benchmarks").symlink_to(REPO / "benchmarks", target_is_directory=True)
        found = Interpreter(python=str(python), cwd=start, drop_env=("PYTHONPATH",))
        version = _check(found, folder, requirement)
        _say(f"children run cockpit {version} from {folder}")
        yield found, f"cockpit-for-pytorch {version}"
