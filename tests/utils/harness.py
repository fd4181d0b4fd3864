"""Run a cockpit through a few training steps and replay them for brute-force twins.

``run(problem, quantities, steps)`` trains with the cockpit and records, for every
step, the batch and the parameters at the moment the cockpit context was left (after
the backward, before ``optimizer.step()``). A brute-force reference can then recompute
any quantity from those snapshots with plain autograd.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cockpit import Cockpit


@dataclass
class Record:
    step: int
    x: torch.Tensor
    y: torch.Tensor
    params: list  # detached parameter values when the context was left
    grads: list  # .grad when the context was left
    lr: float


@dataclass
class Run:
    cockpit: Cockpit
    records: dict = field(default_factory=dict)

    @property
    def output(self):
        """The quantities' values per step (without the recorded learning rates)."""
        output = {}
        for step, entries in self.cockpit.history.to_dict().items():
            entries.pop("learning_rates", None)
            if entries:
                output[step] = entries
        return output


def run(problem, quantities, steps: int = 4, extra_info=None, cockpit_cls=Cockpit):
    """Train ``steps`` steps of ``problem`` while tracking ``quantities``."""
    optimizer = problem.optimizer()
    cockpit = cockpit_cls(problem.params, quantities=quantities)
    result = Run(cockpit)
    for step in range(steps):
        x, y = problem.make_batch(step)
        optimizer.zero_grad()
        outputs = problem.model(x)
        loss = problem.loss_fn(outputs, y)
        losses = problem.individual_loss_fn(outputs, y)
        info = {
            "batch_size": x.shape[0],
            "individual_losses": losses,
            "loss": loss,
            "optimizer": optimizer,
        }
        info.update(extra_info or {})
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        result.records[step] = Record(  # on the CPU: brute force runs there
            step=step,
            x=x.cpu(),
            y=y.cpu(),
            params=[p.detach().cpu().clone() for p in problem.params],
            grads=[p.grad.detach().cpu().clone() for p in problem.params],
            lr=optimizer.param_groups[0]["lr"],
        )
        optimizer.step()
    return result
