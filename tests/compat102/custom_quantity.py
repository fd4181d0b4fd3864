"""Custom quantities written against cockpit-for-pytorch 1.0.2's subclass API.

1.0.2 documents its base classes in ``cockpit.quantities.quantity``: a quantity
names the BackPACK extensions it needs in ``extensions(global_step)`` and computes
its value after the backward pass in ``_compute(global_step, params, batch_loss)``
(single step) or ``_compute_start`` / ``_compute_end`` with ``save_to_cache`` /
``load_from_cache`` (two steps, ``SAVE_SHIFT``). Values land in ``.output`` /
``get_output()`` of the quantity and in the cockpit's output under the class name.

Three quantities, run next to the ``economy`` configuration:

* :class:`MaxIndividualGradNorm` (SingleStep): ``max_i ||g_i||`` from BackPACK's
  ``BatchGrad`` (``p.grad_batch`` holds ``g_i / N`` for a mean-reduced loss).
* :class:`GradCosine` (TwoStep, stored under the start step): cosine between the
  mini-batch gradients of step ``t`` and ``t + 1``.
* :class:`ParamNorm` (Byproduct): ``||theta||`` over all parameters.

Run: ``python tests/compat102/custom_quantity.py --steps 5 --outdir DIR``.
"""

import os

import torch
from backpack import extend
from backpack.extensions import BatchGrad
from utils102 import digits_data, mlp, parse_args

from cockpit import Cockpit
from cockpit.quantities.quantity import (
    ByproductQuantity,
    SingleStepQuantity,
    TwoStepQuantity,
)
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear


class MaxIndividualGradNorm(SingleStepQuantity):
    """Largest per-sample gradient norm ``max_i ||g_i||`` over the mini-batch."""

    def extensions(self, global_step):
        """Individual gradients on scheduled steps."""
        return [BatchGrad()] if self.should_compute(global_step) else []

    def protected_savefields(self, global_step):
        """Keep ``grad_batch`` until ``_compute`` has read it."""
        return {"grad_batch"} if self.should_compute(global_step) else set()

    def _compute(self, global_step, params, batch_loss):
        """Undo BackPACK's ``1/N`` and take the largest norm."""
        grad_batch = torch.cat([p.grad_batch.flatten(start_dim=1) for p in params], 1)
        batch_size = grad_batch.shape[0]
        return (batch_size * grad_batch).norm(dim=1).max().item()


class GradCosine(TwoStepQuantity):
    """Cosine between the mini-batch gradients of steps ``t`` and ``t + 1``."""

    SAVE_SHIFT = 1

    def extensions(self, global_step):
        """Needs only ``.grad``."""
        return []

    def is_start(self, global_step):
        """Start on scheduled steps."""
        return self._track_schedule(global_step)

    def is_end(self, global_step):
        """End one step after a start."""
        return self._track_schedule(global_step - 1)

    def _compute_start(self, global_step, params, batch_loss):
        grad = torch.cat([p.grad.detach().flatten() for p in params]).clone()
        end = global_step + 1
        self.save_to_cache(global_step, "grad", grad, block_fn=lambda s: s <= end)

    def _compute_end(self, global_step, params, batch_loss):
        start_grad = self.load_from_cache(global_step - 1, "grad")
        grad = torch.cat([p.grad.detach().flatten() for p in params])
        return torch.nn.functional.cosine_similarity(start_grad, grad, dim=0).item()


class ParamNorm(ByproductQuantity):
    """``||theta||_2`` of all parameters (no BackPACK extension needed)."""

    def _compute(self, global_step, params, batch_loss):
        return torch.cat([p.detach().flatten() for p in params]).norm().item()


def make_quantities(max_norm_every=2):
    """The three custom quantities (fresh instances)."""
    return [
        MaxIndividualGradNorm(linear(max_norm_every)),
        GradCosine(linear(1)),
        ParamNorm(linear(1), verbose=False),
    ]


def main(steps=5, outdir="compat102_out"):
    """Train with the custom quantities and ``economy``; return them, the cockpit."""
    data = digits_data()
    torch.manual_seed(1)
    model = extend(mlp())
    loss_fn = extend(torch.nn.CrossEntropyLoss(reduction="mean"))
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    custom = make_quantities()
    cockpit = Cockpit(model.parameters(), quantities=custom + configuration("economy"))

    global_step = 0
    for inputs, labels in iter(data):
        opt.zero_grad()
        outputs = model(inputs)
        loss = loss_fn(outputs, labels)
        losses = individual_loss_fn(outputs, labels).detach()

        with cockpit(
            global_step,
            info={
                "batch_size": inputs.shape[0],
                "individual_losses": losses,
                "loss": loss,
                "optimizer": opt,
            },
        ):
            loss.backward(create_graph=cockpit.create_graph(global_step))

        opt.step()
        global_step += 1
        if global_step >= steps:
            break

    for quantity in custom:
        print(type(quantity).__name__, dict(quantity.get_output()))
    cockpit.write(os.path.join(outdir, "custom_log"))
    return custom, cockpit


if __name__ == "__main__":
    args = parse_args(default_steps=5)
    main(args.steps, args.outdir)
