"""cockpit-for-pytorch 1.0.2's optimizer helper, for quantities copied from it.

1.0.2's CABS and EarlyStopping check ``ComputeStep.is_sgd_default_kwargs``; a
custom quantity copied from them keeps working. cockpit's own quantities use
:mod:`cockpit.quantities.optim`.
"""

from __future__ import annotations

from cockpit.quantities.optim import is_plain_sgd


class ComputeStep:
    """Which optimizers' steps 1.0.2 could compute, and the step of plain SGD."""

    @staticmethod
    def is_sgd_default_kwargs(optimizer) -> bool:
        """Whether ``optimizer`` is plain SGD.

        That is ``torch.optim.SGD`` without momentum, dampening, weight decay or
        Nesterov in every group.
        """
        return is_plain_sgd(optimizer)

    @staticmethod
    def compute_update_step(optimizer, parameter_ids):
        """The update of plain SGD, ``-lr * sum_i g_i``, per parameter id.

        Reads BackPACK's per-sample gradients (``BatchGrad``) off the parameters,
        as 1.0.2.

        Raises:
            NotImplementedError: For any other optimizer (as 1.0.2).
        """
        if not ComputeStep.is_sgd_default_kwargs(optimizer):
            raise NotImplementedError(
                "ComputeStep only computes the step of plain torch.optim.SGD. "
                "cockpit's Alpha replays any optimizer's step itself."
            )
        return ComputeStep.update_sgd_default_kwargs(optimizer, parameter_ids)

    @staticmethod
    def update_sgd_default_kwargs(optimizer, parameter_ids):
        """``{id(p): -lr * (sum of p's per-sample gradients)}`` for the given ids."""
        from cockpit.engines.backpack.api import stored_per_sample

        wanted = set(parameter_ids)
        updates = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in wanted:
                    per_sample = stored_per_sample(p)
                    updates[id(p)] = -group["lr"] * per_sample.sum(0).detach()
        missing = wanted - set(updates)
        if missing:
            raise ValueError(
                f"{len(missing)} parameter(s) are not in the optimizer's groups."
            )
        return updates
