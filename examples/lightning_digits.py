"""Lightning: cockpit as a callback of an ordinary ``Trainer.fit``.

An MLP learns scikit-learn's handwritten digits with a plain ``LightningModule``
(SGD with momentum, a step-wise learning-rate schedule, a validation loop). The only
cockpit line is the callback::

    trainer = Trainer(callbacks=[CockpitCallback(quantities=configuration("economy"))])

The module computes its loss with a loss *module* (``self.loss_fn``), which
BackPACK needs and from which the callback takes the per-sample losses; nothing
else in it knows about cockpit. The log streams to ``<log_dir>/cockpit.jsonl``; with
TensorBoard installed the trainer logs to TensorBoard and the callback exports the
cockpit's values into the same run (``tensorboard --logdir <out>``).

With ``--accumulate k`` the trainer accumulates the gradients of ``k`` micro-batches
per optimizer step (``accumulate_grad_batches=k``); the callback then tracks the
first micro-batch of every optimizer step and records Alpha as missing (the step is
the whole window's).

Run: ``python examples/lightning_digits.py [--steps 150] [--out lightning_output]
[--accumulate 1]``; needs the ``lightning`` extra, installed as
``docs/integrations.md`` says (``.venv/bin/pip install -c constraints.txt -e
".[lightning,demo]" && .venv/bin/pip uninstall -y torchvision``). Writes the log
and ``<out>/dashboard.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings

# before lightning: a torchvision that cannot load is reported with its fix
from cockpit.integrations.lightning import CockpitCallback  # isort: split

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import nn

from cockpit import CockpitPlotter
from cockpit.utils.configuration import configuration


class DigitsClassifier(pl.LightningModule):
    """An ordinary LightningModule: nothing here knows about cockpit."""

    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
            nn.Linear(32, 10),
        )  # fmt: skip
        self.loss_fn = nn.CrossEntropyLoss()  # a module, mean-reduced
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", self.loss_fn(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": schedule, "interval": "step"},
        }


def digits_loaders(batch_size: int = 64, seed: int = 0):
    """Train and validation loaders of the standardised digits."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, valid = order[:1500], order[1500:]
    make = torch.utils.data.TensorDataset
    return (
        torch.utils.data.DataLoader(
            make(x[train], y[train]), batch_size=batch_size, shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        ),
        torch.utils.data.DataLoader(make(x[valid], y[valid]), batch_size=256),
    )  # fmt: skip


def main(
    steps: int = 150,
    out: str = "lightning_output",
    config: str = "economy",
    accumulate: int = 1,
) -> dict[str, str]:
    """Fit with the cockpit callback; return the paths of the log and dashboard.

    Args:
        steps: Optimizer steps (a test runs a handful).
        out: The trainer's ``default_root_dir``.
        config: ``economy``, ``business`` or ``full``.
        accumulate: Micro-batches per optimizer step (``accumulate_grad_batches``).
    """
    pl.seed_everything(0, verbose=False)
    callback = CockpitCallback(quantities=configuration(config))
    has_tensorboard = importlib.util.find_spec("tensorboard") is not None
    trainer = pl.Trainer(
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        accelerator="cpu",
        devices=1,
        default_root_dir=out,
        logger=True if has_tensorboard else False,  # TensorBoardLogger
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(),  # Lightning's bar, on a terminal
        enable_model_summary=False,
        log_every_n_steps=10,
        val_check_interval=min(steps, 20),
        check_val_every_n_epoch=None,
        limit_val_batches=1,
    )
    train, valid = digits_loaders()
    trainer.fit(DigitsClassifier(), train, valid)

    logpath = callback.cockpit.logpath
    plotter = CockpitPlotter()
    plotter.plot(logpath, show_plot=False, plot_title="Lightning: SGD on digits")
    (dashboard,) = plotter.save(f"{out}/dashboard.png")
    return {"log": logpath, "dashboard": dashboard, "log_dir": trainer.log_dir}


if __name__ == "__main__":
    # PyTorch warns when BackPACK's hook fires on the first layer, whose input needs
    # no gradient; that is expected and harmless.
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default="lightning_output")
    parser.add_argument("--config", default="economy")
    parser.add_argument("--accumulate", type=int, default=1)
    args = parser.parse_args()
    for name, path in main(args.steps, args.out, args.config, args.accumulate).items():
        print(f"{name}: {path}")
