"""The advanced example of cockpit-for-pytorch 1.0.2, as a user of 1.0.2 wrote it.

A CNN, a hand-picked list of quantities on their own schedules, an extra BackPACK
extension (``DiagHessian``) whose results the user reads, dashboards saved (not
shown) every few steps into the folder ``logfiles/cockpit_output/``, the log written
to ``logfiles/cockpit_output`` (that is ``logfiles/cockpit_output.json``, next to the
folder of the same name) and finally a dashboard drawn from that log.

Run: ``python tests/compat102/advanced.py --steps 6 --outdir DIR``.
"""

import torch
from backpack import extend, extensions
from utils102 import cnn, digits_data, get_logpath, parse_args

from cockpit import Cockpit, CockpitPlotter, quantities
from cockpit.utils import schedules

#: Draw a dashboard every ``PLOT_EVERY`` steps.
PLOT_EVERY = 2


def main(steps=6, outdir="compat102_out"):
    """Train for ``steps`` steps; return the cockpit, the plotter and the log path.

    Also returns, per step, whether every parameter held the user's ``diag_h``
    right after the backward pass.
    """
    data = digits_data()
    model = extend(cnn())
    loss_fn = extend(torch.nn.CrossEntropyLoss(reduction="mean"))
    individual_loss_fn = extend(torch.nn.CrossEntropyLoss(reduction="none"))

    opt = torch.optim.SGD(model.parameters(), lr=5e-1)

    tracked = [
        quantities.GradNorm(schedules.linear(interval=1)),
        quantities.Distance(schedules.linear(interval=1)),
        quantities.UpdateSize(schedules.linear(interval=1)),
        quantities.HessMaxEV(schedules.linear(interval=3)),
        quantities.GradHist1d(schedules.linear(interval=2), bins=10),
    ]
    cockpit = Cockpit(model.parameters(), quantities=tracked)
    plotter = CockpitPlotter()
    logpath = get_logpath(outdir)

    diag_h_seen = {}
    global_step = 0
    for inputs, labels in iter(data):
        opt.zero_grad()

        outputs = model(inputs)
        loss = loss_fn(outputs, labels)
        losses = individual_loss_fn(outputs, labels)

        with cockpit(
            global_step,
            extensions.DiagHessian(),  # more BackPACK results, for the user
            info={
                "batch_size": inputs.shape[0],
                "individual_losses": losses,
                "loss": loss,
                "optimizer": opt,
            },
        ):
            loss.backward(create_graph=cockpit.create_graph(global_step))

        diag_h_seen[global_step] = all(
            hasattr(p, "diag_h") and p.diag_h.shape == p.shape
            for p in model.parameters()
        )

        opt.step()
        global_step += 1

        print(f"Step: {global_step:5d} | Loss: {loss.item():.4f}")

        if global_step % PLOT_EVERY == 0:
            plotter.plot(
                cockpit,
                savedir=logpath,
                show_plot=False,
                save_plot=True,
                savename_append=str(global_step),
            )

        if global_step >= steps:
            break

    cockpit.write(logpath)

    plotter.plot(
        logpath,
        savedir=logpath,
        show_plot=False,
        save_plot=True,
        savename_append="_final",
    )
    return cockpit, plotter, logpath, diag_h_seen


if __name__ == "__main__":
    args = parse_args(default_steps=6)
    *_, seen = main(args.steps, args.outdir)
    print(f"diag_h after every step: {all(seen.values())}")
