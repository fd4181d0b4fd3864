"""What quantities need to know about the optimizer of a step.

* whether it is *plain SGD* (``torch.optim.SGD`` with momentum 0, dampening 0,
  weight decay 0, no Nesterov, not maximising, in every group) -- CABS and
  EarlyStopping are only defined for it, and Alpha projects cheaply for it;
* each parameter's learning rate;
* the update an optimizer step *would* make to one parameter, replayed on copies
  (Alpha uses it to project per-sample gradients onto the step inside the backward
  pass for optimizers other than plain SGD).
"""

from __future__ import annotations

import copy
import inspect
from typing import Sequence

import torch
from torch import Tensor

from cockpit.precision import compute_dtype

# Group settings of plain SGD and their neutral values.
_PLAIN_SGD_SETTINGS = (
    ("momentum", 0),
    ("dampening", 0),
    ("weight_decay", 0),
    ("nesterov", False),
    ("maximize", False),
)


def _elementwise_classes() -> tuple[type, ...]:
    names = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop")
    names += ("Adagrad", "Adadelta", "ASGD", "Rprop")
    return tuple(getattr(torch.optim, n) for n in names if hasattr(torch.optim, n))


def is_elementwise(optimizer) -> bool:
    """Whether ``optimizer``'s update of each parameter element depends only on it.

    That element, its gradient and its state, with the group's settings: the
    ``torch.optim`` optimizers other than LBFGS, SparseAdam and Adafactor (whose
    second moment is factored over rows and columns), of exactly those classes
    (a subclass may change the update). Such an update can be replayed on any
    rows of a parameter (FSDP2's shards).
    """
    return type(optimizer) in _elementwise_classes()


class ReplayError(RuntimeError):
    """An optimizer step could not be replayed for a single parameter."""


def plain_sgd_violation(optimizer) -> str | None:
    """Say why ``optimizer`` is not plain SGD.

    Args:
        optimizer: Any object (normally a ``torch.optim.Optimizer``).

    Returns:
        ``None`` for plain SGD, else a short reason such as
        ``"momentum=0.9 in param group 0"`` or ``"the optimizer is Adam, not
        torch.optim.SGD"``.
    """
    if type(optimizer) is not torch.optim.SGD:
        return f"the optimizer is {type(optimizer).__name__}, not torch.optim.SGD"
    for index, group in enumerate(optimizer.param_groups):
        for name, neutral in _PLAIN_SGD_SETTINGS:
            value = group.get(name, neutral)
            if value != neutral:
                return f"{name}={value!r} in param group {index}"
    return None


def is_plain_sgd(optimizer) -> bool:
    """Return whether ``optimizer`` is plain SGD (see :func:`plain_sgd_violation`)."""
    return plain_sgd_violation(optimizer) is None


def require_plain_sgd(optimizer, who: str, single_lr: bool = False) -> float | None:
    """Check that ``optimizer`` is plain SGD, or fail with the setting at fault.

    Args:
        optimizer: The step's optimizer (``info["optimizer"]``).
        who: The quantity's name, for the message.
        single_lr: Also require one learning rate shared by all groups.

    Returns:
        The learning rate if ``single_lr``, else ``None``.

    Raises:
        ValueError: Naming the offending setting and the fix.
    """
    reason = plain_sgd_violation(optimizer)
    if reason is None and single_lr:
        rates = [float(group["lr"]) for group in optimizer.param_groups]
        if len(set(rates)) > 1:
            listed = ", ".join(
                f"lr={r!r} in param group {i}" for i, r in enumerate(rates)
            )
            reason = f"the param groups have different learning rates ({listed})"
    if reason is not None:
        extra = " with a single learning rate" if single_lr else ""
        raise ValueError(
            f"{who} is only defined for plain SGD{extra} (torch.optim.SGD with "
            "momentum=0, dampening=0, weight_decay=0, nesterov=False), but "
            f"{reason}. Fix: train with plain torch.optim.SGD, or remove {who} from "
            "the cockpit's quantities."
        )
    return float(optimizer.param_groups[0]["lr"]) if single_lr else None


def group_index(optimizer, params: Sequence[Tensor]) -> list[int | None]:
    """Return, for each parameter, the index of its optimizer group (or ``None``)."""
    owner = {
        id(p): index
        for index, group in enumerate(optimizer.param_groups)
        for p in group["params"]
    }
    return [owner.get(id(p)) for p in params]


def learning_rates(optimizer, params: Sequence[Tensor]) -> list[float]:
    """Return each parameter's learning rate (``0.0`` if the optimizer lacks it)."""
    groups = optimizer.param_groups
    return [
        0.0 if g is None else float(groups[g]["lr"])
        for g in group_index(optimizer, params)
    ]


def rebuilt(optimizer, groups: list[dict]):
    """An optimizer of ``optimizer``'s class over ``groups``; it never steps.

    The groups carry every setting, so the class is called with them alone
    (``torch.optim`` optimizers default the rest); a constructor that wants more
    gets the optimizer's ``defaults`` it accepts (``AdamW.defaults`` holds
    ``decoupled_weight_decay``, which ``AdamW()`` does not take).
    """
    cls = type(optimizer)
    try:
        return cls(groups)
    except TypeError:
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return cls(groups, **defaults)


def rebuilt_over(optimizer, params: Sequence[Tensor], tensors: Sequence[Tensor]):
    """:func:`rebuilt` with each of ``params`` replaced by its twin in ``tensors``.

    The groups keep their settings and hold the twins of the parameters they
    own (FSDP2: the full tensors, or a process's rows); ``None`` if no group
    holds any of ``params``.
    """
    by_id = {id(p): t for p, t in zip(params, tensors, strict=True)}
    groups = []
    for group in optimizer.param_groups:
        held = [by_id[id(p)] for p in group["params"] if id(p) in by_id]
        if held:
            groups.append({**group, "params": held})
    return rebuilt(optimizer, groups) if groups else None


def replay_update(optimizer, param: Tensor, grad: Tensor) -> Tensor:
    """Return the change ``optimizer.step()`` would make to ``param`` given ``grad``.

    The step is run by a fresh optimizer of the same class on a copy of ``param``,
    with a copy of the parameter's group settings and optimizer state, so neither
    ``optimizer`` nor ``param`` changes. This is exact for optimizers whose update
    of a parameter depends only on that parameter, its gradient, its state and its
    group (all ``torch.optim`` optimizers except LBFGS).

    Args:
        optimizer: The optimizer that will make the step.
        param: One parameter (its current value is used).
        grad: The gradient ``optimizer.step()`` will see for ``param``.

    Returns:
        ``theta_new - theta``, shaped like ``param`` (zeros if the optimizer does not
        own ``param``).

    Raises:
        ReplayError: If the optimizer cannot be rebuilt or stepped this way.
    """
    (index,) = group_index(optimizer, [param])
    if index is None:
        return torch.zeros_like(param)
    settings = {k: v for k, v in optimizer.param_groups[index].items() if k != "params"}
    shadow = param.detach().clone().requires_grad_(True)
    # the optimizer sees .grad in the parameter's dtype (a half-precision model's
    # gradient statistics arrive in float32)
    shadow.grad = grad.detach().to(dtype=param.dtype, copy=True)
    try:
        twin = type(optimizer)([dict(settings, params=[shadow])])
        state = optimizer.state.get(param)
        if state:
            twin.state[shadow] = copy.deepcopy(state)
        with torch.no_grad():
            twin.step()
    except (TypeError, ValueError, RuntimeError, KeyError) as error:
        raise ReplayError(
            f"{type(optimizer).__name__}.step() could not be replayed for a single "
            f"parameter ({type(error).__name__}: {error})"
        ) from error
    dtype = compute_dtype(param.dtype)  # the difference of two bfloat16 is float32
    return shadow.detach().to(dtype) - param.detach().to(dtype)
