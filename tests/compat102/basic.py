"""The basic example of cockpit-for-pytorch 1.0.2, as a user of 1.0.2 wrote it.

A classifier on digits, the ``full`` configuration, the dashboard redrawn after every
step (headless with the Agg backend), then saved, and the log written.

Run: ``python tests/compat102/basic.py --steps 4 --outdir DIR``.
"""

import os

import torch
from backpack import extend
from utils102 import digits_data, mlp, parse_args

from cockpit import Cockpit, CockpitPlotter
from cockpit.utils.configuration import configuration


def main(steps=4, outdir="compat102_out"):
    """Train for ``steps`` steps; return the cockpit and the plotter."""
    data = digits_data()
    model = extend(mlp())
    loss_fn = extend(torch.nn.CrossEntropyLoss(reduction="mean"))
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")

    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    cockpit = Cockpit(model.parameters(), quantities=configuration("full"))
    plotter = CockpitPlotter()

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

        print(f"Step: {global_step:5d} | Loss: {loss.item():.4f}")

        plotter.plot(cockpit)

        if global_step >= steps:
            break

    plotter.plot(cockpit, savedir=outdir, show_plot=False, save_plot=True)
    cockpit.write(os.path.join(outdir, "basic_log"))
    return cockpit, plotter


if __name__ == "__main__":
    args = parse_args(default_steps=4)
    main(args.steps, args.outdir)
