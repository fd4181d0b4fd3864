"""Same-run comparison with the reference package (``--reference``).

cockpit-for-pytorch 1.0.2 installs the same top-level package ``cockpit`` as this
checkout, so it runs in its own throwaway virtual environment, outside the
repository. Its children start from a folder that holds only a link to
``benchmarks/`` and run without ``PYTHONPATH``: ``import cockpit`` finds 1.0.2,
``import benchmarks`` this checkout's harness. The environment sees this
interpreter's packages through a path file, so torch, BackPACK and numpy are the very
ones our children use (torch pinned by ``-c constraints.txt`` all the same) and
nothing large is downloaded. pip installs the package without its dependencies, then
those of its direct requirements that no shared package provides (for 1.0.2: seaborn
and json-tricks), and ``setuptools<81`` (1.0.2 imports ``pkg_resources``); these
copies come first on the path.
"""

from __future__ import annotations

import contextlib
import json
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
#: Prints the requirements of a distribution whose package is not installed at all.
_MISSING = """
import importlib.metadata as m, re, sys
for r in m.requires(sys.argv[1]) or []:
    if "extra ==" in r:
        continue
    try:
        m.distribution(re.split(r"[<>=!~ ;(\\[]", r.strip(), maxsplit=1)[0])
    except m.PackageNotFoundError:
        print(r)
"""


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
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    if CONSTRAINTS.exists():
        pip += ["-c", str(CONSTRAINTS)]
    # Without its dependencies first: pip would otherwise also install what the
    # shared packages lack (BackPACK's torchvision, built for another torch).
    subprocess.run(pip + ["--no-deps", requirement, "setuptools<81"], check=True)
    missing = subprocess.run(
        [str(python), "-c", _MISSING, _distribution(requirement)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    missing = [line for line in missing if line.strip()]
    if missing:
        _say(f"installing what it needs beyond the shared packages: {missing}")
        subprocess.run(pip + missing, check=True)
    return python


def _distribution(requirement: str) -> str:
    """The distribution name of a requirement (``cockpit-for-pytorch==1.0.2``)."""
    return re.split(r"[<>=!~ \[;]", requirement.strip(), maxsplit=1)[0]


def _describe(interpreter: Interpreter, venv: Path, requirement: str) -> dict:
    """Ask the children's interpreter which cockpit it imports; check it is ours.

    Returns:
        :func:`benchmarks.internals.describe` of that interpreter.
    """
    proc = subprocess.run(
        [interpreter.python, "-m", "benchmarks.internals", _distribution(requirement)],
        cwd=interpreter.cwd,
        env={k: v for k, v in os.environ.items() if k not in interpreter.drop_env},
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(found["file"]).resolve().is_relative_to(venv.resolve()):
        raise RuntimeError(
            f"the reference children import cockpit from {found['file']}, not from "
            f"the environment in {venv}"
        )
    return found


@contextlib.contextmanager
def interpreter(venv=None, requirement: str = PACKAGE):
    """Yield ``(Interpreter, name, about)`` for children of the reference package.

    ``name`` is the distribution and version (``cockpit-for-pytorch 1.0.2``),
    ``about`` :func:`benchmarks.internals.describe` run by that interpreter.

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
        about = _describe(found, folder, requirement)
        _say(f"children run {requirement} from {about['file']}")
        yield found, f"{_distribution(requirement)} {about['version']}", about
