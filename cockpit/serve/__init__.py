"""``cockpit serve``: the dashboard of runs in progress, live in a browser.

Like ``tensorboard --logdir``: point it at the folder(s) your runs write their
logs to (``Cockpit(..., logpath=...)``), forward the port, open the page::

    cockpit serve runs/ --port 6007          # on the training machine
    ssh -L 6007:localhost:6007 gpu-box       # on yours; open http://localhost:6007

Or start it from the training script itself (two lines; it serves from a
background thread until the script ends)::

    from cockpit.serve import start
    start("runs", port=6007)

The page is the interactive dashboard of ``cockpit plot --html``; new steps and
new runs appear without a reload. See ``docs/serve.md``: what it reads, what it
answers, and why it is safe to leave running.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # the server (and the dashboard page's plotting) load on use
    from cockpit.serve.server import Server

__all__ = ["Server", "start"]


def __getattr__(name: str) -> Any:
    """``cockpit.serve.Server``, imported when first used.

    So ``cockpit --help`` and the other commands load neither the server nor
    plotting.
    """
    if name == "Server":
        from cockpit.serve.server import Server

        return Server
    raise AttributeError(f"module 'cockpit.serve' has no attribute {name!r}")


def start(
    paths: str | Sequence[str], port: int = 6007, host: str = "127.0.0.1"
) -> Server:
    """Serve the dashboard of the logs under ``paths`` from a background thread.

    Args:
        paths: A folder (searched at any depth) or log file, or several.
        port: TCP port (0: any free one; see ``Server.url``).
        host: Address to listen on; the default serves this machine only.

    Returns:
        The running :class:`Server` (``.url``, ``.shutdown()``).

    Raises:
        OSError: If the port is in use.
    """
    from cockpit.serve.server import Server

    paths = [paths] if isinstance(paths, str) else list(paths)
    server = Server(paths, port=port, host=host).start()
    print(f"cockpit serve: the dashboard is at {server.url}", flush=True)
    return server
