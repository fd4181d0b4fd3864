"""Programs run as fresh processes forked from one interpreter that imported for them.

Starting a Python process that imports torch takes seconds; tests that need programs
in processes of their own (not pytest's) run them here instead: one interpreter
imports ``preload`` once and forks a child per program, which runs it as ``python -c
CODE``, ``python -m MODULE`` or ``python SCRIPT`` would (``sys.argv``, ``sys.path[0]``,
``__main__``, the working directory), its standard output and error going to files.
Its imports of the preloaded modules find them imported (nothing else was run).
Programs run on one torch thread: two beside the other test worker are much slower.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

#: The interpreter's program: ``sys.argv[1]`` is the JSON of ``(preload, check,
#: cases)``; the child's exit status goes to a file too (the parent only waits).
FORKING = textwrap.dedent(
    """
    import importlib, json, logging, os, runpy, sys, traceback

    preload, check, cases = json.loads(sys.argv[1])
    for name in preload:
        importlib.import_module(name)
    exec(check, {})

    def run(case):
        if "cwd" in case:
            os.chdir(case["cwd"])
        if "module" in case:
            sys.argv = [case["module"], *case["argv"]]
            runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
        elif "path" in case:
            sys.argv = [case["path"], *case["argv"]]
            sys.path[0] = os.path.dirname(os.path.abspath(case["path"]))
            runpy.run_path(case["path"], run_name="__main__")
        else:
            sys.argv = ["-c"]
            exec(compile(case["code"], "<string>", "exec"), {"__name__": "__main__"})

    for case in cases:
        pid = os.fork()
        if pid:
            os.waitpid(pid, 0)
            continue
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        status = 0
        try:
            run(case)
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 0
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
                status = 1
        except BaseException:
            traceback.print_exc()
            status = 1
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        with open(case["status"], "w") as f:
            f.write(str(status))
        os._exit(status)
    """
)


def run_forked(
    cases: list[dict],
    folder: Path,
    preload: list[str],
    check: str = "",
    env: dict | None = None,
    timeout: float = 600,
) -> list[SimpleNamespace]:
    """Run each case in a child of one interpreter; their returncode, stdout, stderr.

    Args:
        cases: Each ``{"code": CODE}``, ``{"module": NAME, "argv": [...]}`` or
            ``{"path": SCRIPT, "argv": [...]}``, optionally with ``"cwd"``.
        folder: Where the children's output files go.
        preload: Modules the interpreter imports before forking.
        check: Code the interpreter runs after importing them (e.g. asserting that
            the imports left some state alone); an error fails the whole run.
        env: The interpreter's environment (default: this process's), with
            ``OMP_NUM_THREADS=1``: one torch thread, as the tests have in pytest's
            processes (``tests/conftest.py``).
        timeout: Seconds for all cases together.
    """
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    files = [
        {name: str(folder / f"{i}.{name}") for name in ("stdout", "stderr", "status")}
        for i in range(len(cases))
    ]
    payload = json.dumps(
        [preload, check, [case | names for case, names in zip(cases, files)]]
    )
    done = subprocess.run(
        [sys.executable, "-c", FORKING, payload],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = []
    for names in files:
        read = {}
        for name, path in names.items():
            assert os.path.exists(path), f"no {path}: the child died"
            with open(path) as f:
                read[name] = f.read()
        results.append(
            SimpleNamespace(
                returncode=int(read["status"]),
                stdout=read["stdout"],
                stderr=read["stderr"],
            )
        )
    return results
