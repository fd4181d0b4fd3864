"""What a :class:`~cockpit.Cockpit` hands back: its output and checkpoints.

What the cockpit has recorded (:attr:`CockpitOutput.history`, filled through
the recorder) is read back with :meth:`CockpitOutput.get_output` (1.0.2's dict),
written with :meth:`CockpitOutput.write` (standard JSON, or 1.0.2's layout),
extended with evaluation metrics by :meth:`CockpitOutput.log`, and saved and
restored with
:meth:`CockpitOutput.state_dict` / :meth:`CockpitOutput.load_state_dict`.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any, Mapping

from cockpit.errors import CockpitWarning
from cockpit.history import json_path
from cockpit.log.checkpoint import cockpit_state, load_cockpit_state
from cockpit.log.files import empty_run_cause
from cockpit.log.keys import LOG_KEYS
from cockpit.step.console import LOG


class CockpitOutput:
    """Output and checkpoints of a cockpit (its base class; see the module).

    Reads the cockpit's ``history``, ``recorder``, ``_stream``, ``_loop``,
    ``_router`` and ``is_writer``.
    """

    # --- output --------------------------------------------------------------------
    def log(
        self,
        global_step,
        epoch_count,
        train_loss,
        valid_loss,
        test_loss,
        train_accuracy,
        valid_accuracy,
        test_accuracy,
        learning_rate,
    ) -> None:
        """Record evaluation metrics (shown in the dashboard's bottom row)."""
        values = dict(locals())
        for key in LOG_KEYS:
            self.recorder.record(global_step, key, values[key])
        self.recorder.flush()

    def get_output(self) -> collections.defaultdict:
        """Return everything recorded so far as ``{step: {key: value}}``.

        A ``defaultdict(dict)`` as in cockpit-for-pytorch 1.0.2: histogram counts
        and edges are numpy arrays, everything else plain Python. ``history``
        holds the same values as plain Python (``cockpit.history.to_dict()``).
        """
        return self.history.to_output()

    @property
    def output(self) -> collections.defaultdict:
        """Everything recorded so far (cockpit-for-pytorch 1.0.2's attribute)."""
        return self.get_output()

    def write(self, logpath, legacy: bool = False, packed: bool = True) -> str:
        """Write the history to ``logpath + ".json"`` (standard JSON, atomically).

        ``legacy`` writes 1.0.2's json_tricks layout (its plotter reads only
        that); ``packed=False`` writes histograms as plain arrays. Returns the path
        written (``None`` on data-parallel processes other than ``log_rank``).

        A run that tracked no step is written too (``{}``), with a
        :class:`~cockpit.errors.CockpitWarning` that names the likely cause: no
        command can show such a log.

        Raises:
            OSError: If the path cannot be written (the message names it and the
                fix); the history stays in memory, so call ``write`` again.
        """
        if not self.is_writer:
            return None
        path = self.history.write_json(json_path(logpath), legacy=legacy, packed=packed)
        LOG.debug("Cockpit log written to %s", path)
        if not self.history.steps:
            warnings.warn(
                f"Cockpit.write: the run tracked no step, so {path} holds no values "
                "and no cockpit command can show it. "
                f"{empty_run_cause(self.last_step is not None)}",
                CockpitWarning,
                stacklevel=2,
            )
        return path

    @property
    def logpath(self) -> str | None:
        """The file the history is streamed to, or ``None``."""
        return self._stream.path if self._stream is not None else None

    def close(self) -> None:
        """Close the streamed log and other subscribers (all is on disk already)."""
        self._loop.close()
        self.recorder.close()
        self._router.close()

    # --- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a restarted run needs to go on exactly here (after ``opt.step()``).

        See :func:`cockpit.log.checkpoint.cockpit_state`.
        """
        return cockpit_state(self)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore a state from :meth:`state_dict`; the run continues after it.

        See :func:`cockpit.log.checkpoint.load_cockpit_state`.
        """
        load_cockpit_state(self, state, strict)
        self._plan = None
        self._loop.close()
        if self._stream is not None:  # records after the checkpoint are superseded
            self._stream.resume(self.last_step)
