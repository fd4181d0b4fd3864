"""The per-step ``info`` a user hands to the cockpit, as an explicit, frozen object.

A :class:`StepInfo` is built when the cockpit context is entered and passed as an
argument to every quantity that is tracked at that step. cockpit-for-pytorch
1.0.2's getters (:func:`get_individual_losses`, :func:`get_batch_size`,
:func:`get_optimizer`, :func:`get_loss`, :class:`CockpitCTX`) read the ``info`` of
the step being tracked, for quantities written against 1.0.2.
"""

from __future__ import annotations

import contextlib
import warnings
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from cockpit.errors import CockpitWarning

#: The ``info`` keys cockpit's own quantities read, and what each must hold.
KNOWN_INFO_KEYS = {
    "loss": "the mean-reduced mini-batch loss (a scalar tensor)",
    "batch_size": "the number of samples N in the mini-batch (an int)",
    "individual_losses": "the per-sample losses, a tensor of shape [N]",
    "optimizer": "the torch.optim.Optimizer that makes the step",
}


@dataclass(frozen=True)
class StepInfo:
    """What the user said about one training step.

    Attributes:
        global_step: The step number passed to ``cockpit(global_step, ...)``.
        values: The ``info`` dictionary as handed in (not copied deeply).
    """

    global_step: int
    values: Mapping[str, Any] = field(default_factory=dict)

    def has(self, key: str) -> bool:
        """Return whether ``info`` holds ``key``."""
        return key in self.values

    def get(self, key: str, default: Any = None) -> Any:
        """Return ``info[key]``, or ``default`` if it is missing."""
        return self.values.get(key, default)

    def require(self, key: str, who: str = "cockpit") -> Any:
        """Return ``info[key]`` or raise an error that says how to pass it.

        Args:
            key: The info key.
            who: Name of the quantity that needs it (for the message).

        Returns:
            The stored value.

        Raises:
            KeyError: If the key is missing.
        """
        if key not in self.values:
            raise KeyError(missing_info_message(key, who, self.global_step))
        return self.values[key]


def missing_info_message(key: str, who: str, global_step: int) -> str:
    """Build the message for a missing ``info`` key."""
    what = KNOWN_INFO_KEYS.get(key, "a value")
    return (
        f"{who} needs info[{key!r}] ({what}) at step {global_step}, but it was not "
        "handed in. Fix: pass it as "
        f"cockpit({global_step}, info={{{key!r}: ..., ...}})."
    )


# --- cockpit-for-pytorch 1.0.2's getters ----------------------------------------------
# 1.0.2's quantities read the step's ``info`` with ``get_batch_size(global_step)`` and
# friends. Here each StepInfo stays an argument; the quantity base makes the one of
# the step being tracked visible to these getters while a 1.0.2-style method runs
# (``track``, ``compute``, ``_compute(global_step, params, batch_loss)``), in a
# context variable rather than in a process-wide table.
_TRACKED: ContextVar[tuple[StepInfo, ...]] = ContextVar("cockpit_tracked", default=())


@contextlib.contextmanager
def tracking(info: StepInfo) -> Iterator[None]:
    """Make ``info`` readable by the 1.0.2 getters below for the duration."""
    token = _TRACKED.set(_TRACKED.get() + (info,))
    try:
        yield
    finally:
        _TRACKED.reset(token)


def tracked_info(global_step: int) -> StepInfo | None:
    """The ``info`` of ``global_step`` if that step is being tracked, else ``None``.

    Falls back to what was stored with :meth:`CockpitCTX.set` (1.0.2's way of
    handing ``info`` to a quantity tracked by hand).
    """
    for info in reversed(_TRACKED.get()):
        if info.global_step == global_step:
            return info
    if global_step in CockpitCTX.INFO:
        return StepInfo(global_step, CockpitCTX.INFO[global_step])
    return None


class CockpitCTX:
    """1.0.2's store of the ``info`` handed to the cockpit, for the getters below.

    The cockpit does not write here (while a quantity is tracked the getters read the
    step's ``info`` directly); :meth:`set` is for code that tracks a quantity by
    hand, as 1.0.2's tests did.
    """

    INFO: dict[int, Mapping[str, Any]] = {}

    @staticmethod
    def set(info: Mapping[str, Any], global_step: int) -> None:
        """Store ``info`` for ``global_step``."""
        CockpitCTX.INFO[global_step] = info

    @staticmethod
    def get(name: str, global_step: int) -> Any:
        """Return ``info[name]`` of ``global_step``.

        Raises:
            KeyError: If the step is not being tracked or has no ``name``.
        """
        info = tracked_info(global_step)
        if info is None:
            raise KeyError(
                f"Please hand in '{name}' via cockpit(info=...): step {global_step} "
                "is not being tracked. The cockpit.context getters read the info of "
                "the step whose quantities are being tracked; outside a cockpit "
                "step, store it first with CockpitCTX.set(info, global_step)."
            )
        return info.require(name, "this quantity")

    @staticmethod
    def erase() -> None:
        """Forget everything stored with :meth:`set`."""
        CockpitCTX.INFO = {}


def get_individual_losses(global_step: int) -> Any:
    """Return ``info["individual_losses"]`` of the step being tracked (1.0.2)."""
    return CockpitCTX.get("individual_losses", global_step)


def get_batch_size(global_step: int) -> Any:
    """Return ``info["batch_size"]`` of the step being tracked (1.0.2)."""
    return CockpitCTX.get("batch_size", global_step)


def get_optimizer(global_step: int) -> Any:
    """Return ``info["optimizer"]`` of the step being tracked (1.0.2)."""
    return CockpitCTX.get("optimizer", global_step)


def get_loss(global_step: int) -> Any:
    """Return ``info["loss"]`` of the step being tracked; warn if it is NaN (1.0.2)."""
    loss = CockpitCTX.get("loss", global_step)
    isnan = getattr(loss, "isnan", None)
    if isnan is not None and bool(isnan().any()):
        warnings.warn(
            f"[Step {global_step}] Mini-batch loss is {loss}. This may break the "
            "computation of quantities.",
            CockpitWarning,
            stacklevel=2,
        )
    return loss
