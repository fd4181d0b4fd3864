"""Writing your own quantity: the largest per-sample gradient norm in each batch.

A single sample whose gradient is far larger than the rest (a mislabelled example, an
outlier input) can dominate a step. This quantity records ``max_i ||g_i||`` over the
samples of the mini-batch, where ``g_i`` is the gradient of sample ``i``'s loss with
respect to all observed parameters.

The recipe for a quantity:

1. Subclass :class:`cockpit.quantities.SingleStepQuantity` (one value per tracked step).
2. Declare ``needs``: what you read during the backward pass. ``Need.BATCH_L2``
   (per-sample squared norms) lets the cockpit run BackPACK's cheap ``BatchL2Grad``
   -- or reuse ``BatchGrad`` if another quantity needs it anyway. The base class
   applies the schedule: nothing is computed on steps it does not track.
3. Declare ``Accumulator``: a dataclass for the step's partial results, fresh each
   step as ``self.acc`` (``PerParameter`` holds one entry per parameter).
4. ``accumulate(step, view)``: called once per parameter while BackPACK's buffers are
   alive; keep a small summary (here an ``[N]`` vector), never the buffers.
5. ``_compute(step, ctx)``: combine the summaries into the value for the history.

Run: ``python examples/custom_quantity.py`` (prints the tracked values).
"""

from __future__ import annotations

import torch
from backpack import extend

from cockpit import Cockpit
from cockpit.needs import Need
from cockpit.quantities import PerParameter, SingleStepQuantity
from cockpit.utils.schedules import linear


class MaxSampleGradNorm(SingleStepQuantity):
    """``max_i ||g_i||_2``: the largest per-sample gradient norm of the mini-batch."""

    #: What it reads: per-sample squared norms (the base applies the schedule).
    needs = frozenset({Need.BATCH_L2})
    #: Its partial results per step: one entry per parameter.
    Accumulator = PerParameter

    def accumulate(self, global_step, view):
        """Keep this parameter's per-sample squared norms (shape ``[N]``)."""
        self.acc.entries[view.index] = view.batch_l2()

    def _compute(self, global_step, ctx):
        squared_norms = sum(self.acc.entries.values())  # sum over parameters -> [N]
        return squared_norms.max().sqrt().item()


def main(steps: int = 20, seed: int = 0) -> dict:
    """Train a small regression net and track :class:`MaxSampleGradNorm`."""
    torch.manual_seed(seed)
    model = extend(
        torch.nn.Sequential(
            torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
    )
    loss_fn = extend(torch.nn.MSELoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model.parameters(), [MaxSampleGradNorm(linear(5))])

    for step in range(steps):
        x = torch.randn(32, 10)
        y = x[:, :1] * 2.0
        y[0] += 10.0 * (step % 2)  # an outlier sample on every other step
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        with cockpit(step, info={"loss": loss}):
            loss.backward()
        optimizer.step()
    return cockpit.get_output()


if __name__ == "__main__":
    for step, values in main().items():
        print(step, values)
