"""The per-step ``info`` a user hands to the cockpit, as an explicit, frozen object.

Nothing here is process-global: a :class:`StepInfo` is built when the cockpit context
is entered and passed as an argument to every quantity that is tracked at that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

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
