"""What quantities written for cockpit-for-pytorch 1.0.2 use of their base class.

The base class (:mod:`cockpit.quantities.base`) runs such quantities unchanged; this
module holds the pieces of 1.0.2's API it builds on:

* :class:`QuantityOutput`, the ``output`` dictionary (``step -> value``) of a
  quantity. It shows what the cockpit recorded under the quantity's key, and a value
  written into it (``self.output[step] = value``, as a 1.0.2 ``track`` does) is
  recorded like any computed value: it shows up in ``Cockpit.get_output()``, the log
  and the dashboard.
* :class:`Helpers102`, 1.0.2's static helpers that read ``.grad`` and BackPACK's
  results off the parameters (``_fetch_grad``, ``_fetch_batch_grad``, ...), which a
  quantity copied from one of 1.0.2's built-ins calls.
* :class:`Alias102`, 1.0.2's private attribute names of the built-in quantities'
  settings (``_epsilon``, ``_bins``, ...), which such a copy reads.
* :class:`Protocol102`, the part of ``Quantity`` that runs 1.0.2's protocol
  (``track``, ``compute``'s results written into ``output``, ``extensions``,
  ``_track_schedule``, ...), and :class:`Cache102`, 1.0.2's cache of two-step
  quantities; the base classes use both, nothing else here names 1.0.2.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from cockpit.context import tracking

if TYPE_CHECKING:
    from cockpit.quantities.base import TrackContext


class QuantityOutput(collections.defaultdict):
    """A quantity's ``{step: value}``, as 1.0.2's ``Quantity.output``.

    A ``defaultdict(dict)``. Reading it gives the values recorded under the
    quantity's key, with histograms as numpy arrays (what
    :meth:`cockpit.Cockpit.get_output` holds); the quantity refills it when the
    history changed. Writing ``output[step] = value`` hands the value to the
    quantity, which records it (see :meth:`cockpit.quantities.Quantity.output`).

    Args:
        on_write: Called with ``(step, value)`` for every value written.
    """

    def __init__(self, on_write: Callable[[Any, Any], None]):
        super().__init__(dict)
        self._on_write = on_write
        #: What the content was read from (the quantity's business).
        self.stamp: Any = None

    def __setitem__(self, step, value) -> None:
        dict.__setitem__(self, step, value)
        self._on_write(step, value)

    def refill(self, items, stamp) -> None:
        """Replace the content by ``items`` (no value is recorded)."""
        dict.clear(self)
        dict.update(self, items)
        self.stamp = stamp

    def __reduce__(self):
        """Copies and pickles are plain ``defaultdict(dict)`` objects."""
        return (collections.defaultdict, (dict,), None, None, iter(dict.items(self)))


class Alias102:
    """A setting under 1.0.2's private attribute name, e.g. ``_epsilon``.

    ``_epsilon = Alias102("epsilon")`` in a class body makes ``self._epsilon`` read
    and write ``self.epsilon``.

    Args:
        name: The attribute that holds the setting.
    """

    def __init__(self, name: str):
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return getattr(instance, self.name)

    def __set__(self, instance, value) -> None:
        setattr(instance, self.name, value)


def takes_params_and_loss(function) -> bool:
    """Whether ``function(self, global_step, params, batch_loss)`` (1.0.2's form)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        and p.default is p.empty
    ]
    # (self, global_step, params, batch_loss); this package's form names ``ctx``
    return len(required) == 4 and required[2].name != "ctx"


def not_implemented(name: str):
    """1.0.2's stand-in for a step method a subclass does not use."""

    def method(self, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__}.{name} is not implemented: the quantity is "
            "tracked through its own track() or compute()."
        )

    method.__name__ = name
    return method


def written_values(values: dict) -> list[tuple[Any, Any]]:
    """The values a 1.0.2-style quantity wrote into ``output`` during a step.

    An empty dict is no value: it is what reading a step not written gives
    (``output`` is a ``defaultdict(dict)``).
    """
    return [(k, v) for k, v in values.items() if not (isinstance(v, dict) and not v)]


def result_pairs(results) -> list[tuple[int, Any]]:
    """``compute``'s results as pairs: 1.0.2 returns one ``(step, value)``."""
    if results is None:
        return []
    if (
        isinstance(results, tuple)
        and len(results) == 2
        and not isinstance(results[0], (tuple, list))
    ):
        return [results]
    return list(results)


def _concat(tensors, start_dim: int = 0):
    return torch.cat([t.flatten(start_dim=start_dim) for t in tensors], dim=start_dim)


class Helpers102:
    """1.0.2's static helpers of ``Quantity``: read results off the parameters.

    Each takes the parameters and ``aggregate``: with ``aggregate=True`` the
    per-parameter results are combined over parameters (concatenated, or summed for
    per-sample norms and dot products), as 1.0.2 did. They read what is on the
    parameters: ``.grad``, and the BackPACK results of the extensions a 1.0.2
    quantity returns from ``extensions(global_step)`` (``BatchGrad``'s,
    ``batch_l2``, ``batch_dot``, ``sum_grad_squared``, a curvature diagonal).
    """

    @staticmethod
    def _fetch_grad(params, aggregate=False):
        """The gradients ``.grad`` (concatenated into one vector if ``aggregate``)."""
        grads = [p.grad for p in params]
        return _concat(grads) if aggregate else grads

    @staticmethod
    def _fetch_grad_l2_squared(params, aggregate=False):
        """``||g_p||^2`` per parameter (summed if ``aggregate``)."""
        norms = [p.grad.pow(2).sum() for p in params]
        return sum(norms) if aggregate else norms

    @staticmethod
    def _fetch_batch_grad(params, aggregate=False):
        """BackPACK's per-sample gradients (``BatchGrad``) per parameter.

        ``[N, D]`` over all parameters if ``aggregate``.
        """
        per_sample = [p.grad_batch for p in params]  # BackPACK's BatchGrad
        return _concat(per_sample, start_dim=1) if aggregate else per_sample

    @staticmethod
    def _fetch_batch_l2_squared(params, aggregate=False):
        """BackPACK's ``batch_l2`` per parameter (summed if ``aggregate``)."""
        batch_l2 = [p.batch_l2 for p in params]
        return sum(batch_l2) if aggregate else batch_l2

    @staticmethod
    def _fetch_batch_dot(params, aggregate=False):
        """BackPACK's ``batch_dot`` per parameter (summed if ``aggregate``)."""
        batch_dot = [p.batch_dot for p in params]
        return sum(batch_dot) if aggregate else batch_dot

    @staticmethod
    def _fetch_sum_grad_squared(params, aggregate=False):
        """BackPACK's ``sum_grad_squared`` (concatenated if ``aggregate``)."""
        moments = [p.sum_grad_squared for p in params]
        return _concat(moments) if aggregate else moments

    @staticmethod
    def _fetch_diag_curvature(params, savefield, aggregate=True):
        """A BackPACK curvature diagonal (``"diag_h"``, ...), concatenated."""
        diagonals = [getattr(p, savefield) for p in params]
        return _concat(diagonals) if aggregate else diagonals

    def _verbose_prefix(self, global_step) -> str:
        return f"[Step {global_step} | {type(self).__name__}]"

    def _save(self, global_step, result) -> None:
        """Record ``result`` under ``global_step`` (1.0.2's ``_save``)."""
        self.output[global_step] = result


class Protocol102(Helpers102):
    """1.0.2's protocol, a part of :class:`~cockpit.quantities.base.Quantity`.

    A quantity written for cockpit-for-pytorch 1.0.2 overrides ``track`` or
    ``compute`` and writes into ``self.output``; it reads its settings under 1.0.2's
    private names and may return BackPACK extensions. The cockpit's own quantities
    use none of it: they declare ``needs`` and compute in ``_compute``.
    """

    #: Whether the class overrides 1.0.2's ``extensions`` / ``extension_hooks``
    #: (set per subclass; the cockpit asks only those that do).
    _asks_extensions: bool = False
    _has_hooks: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._asks_extensions = cls.extensions is not Protocol102.extensions
        cls._has_hooks = cls.extension_hooks is not Protocol102.extension_hooks

    @property
    def _track_schedule(self) -> Callable[[int], bool]:
        """The schedule under 1.0.2's attribute name (read by 1.0.2 subclasses)."""
        return self.track_schedule

    @property
    def _verbose(self) -> bool:
        """``verbose`` under 1.0.2's attribute name."""
        return self.verbose

    def extension_hooks(self, global_step: int) -> list:
        """1.0.2's per-module hooks; cockpit's quantities use ``accumulate``."""
        return []

    def protected_savefields(self, global_step: int) -> set[str]:
        """1.0.2's buffers to keep; results of ``extensions()`` are kept anyway."""
        return set()

    def extensions(self, global_step: int) -> list:
        """Return extra BackPACK extensions to run at this step (1.0.2's API).

        Quantities of this package declare ``needs`` instead. A quantity written
        for cockpit-for-pytorch 1.0.2 returns extensions here and reads their
        results from the parameters in ``_compute(global_step, params,
        batch_loss)``; the cockpit keeps those results until then.
        """
        return []

    def _every_step(self, global_step: int) -> bool:
        """``is_active`` of a quantity that overrides 1.0.2's ``track``."""
        return True

    def track_step(self, global_step: int, ctx: TrackContext) -> list[tuple[int, Any]]:
        """Compute the results due at ``global_step`` (called by the cockpit).

        Subclasses compute here (:class:`SingleStepQuantity` calls ``_compute``,
        :class:`TwoStepQuantity` ``_compute_start`` and ``_compute_end``). This
        default tracks a quantity written for cockpit-for-pytorch 1.0.2 that
        overrides ``track`` or ``compute``: it calls ``track(global_step, params,
        batch_loss)``, with :mod:`cockpit.context`'s getters reading ``ctx.info``,
        and returns what ``track`` wrote into :attr:`output`.

        Returns:
            A list of ``(step_to_store_under, value)``; ``None`` values are skipped.
        """
        try:
            with self._tracked_as_102(ctx) as written:
                self.track(global_step, list(ctx.params), ctx.info.get("loss"))
            return written_values(written)
        finally:
            self.acc = None

    @contextlib.contextmanager
    def _tracked_as_102(self, ctx: TrackContext) -> Iterator[dict]:
        """Run 1.0.2-style code for a step.

        :mod:`cockpit.context`'s getters read ``ctx.info``; the values it writes
        into :attr:`output` are collected in the dict yielded.
        """
        outer = self.__dict__.get("_step_102")
        written: dict = {}
        self.__dict__["_step_102"] = (ctx, written)
        try:
            with tracking(ctx.info):
                yield written
        finally:
            self.__dict__["_step_102"] = outer

    def _native_track_step(self) -> Callable | None:
        """This class's own ``track_step`` (not 1.0.2's route through ``track``)."""
        route = Protocol102.__dict__["track_step"]
        for klass in type(self).__mro__:
            found = klass.__dict__.get("track_step")
            if found is not None and found is not route:
                return found.__get__(self)
        return None

    def track(self, global_step: int, params, batch_loss) -> None:
        """Compute the results due at ``global_step`` and record them (1.0.2's API).

        Each ``(step, value)`` of :meth:`compute` is written into :attr:`output`,
        which records it. The cockpit tracks through :meth:`track_step`; it calls
        this method only for a quantity that overrides it (as 1.0.2 subclasses
        may), and otherwise it is for code that tracks a quantity by hand.
        """
        if not self.is_active(global_step):
            return
        for step, value in result_pairs(self.compute(global_step, params, batch_loss)):
            if value is not None:
                self.output[step] = value

    def _output_written(self, step, value) -> None:
        """A value written into :attr:`output` (``self.output[step] = value``).

        While the cockpit tracks the quantity it is one of the step's results,
        recorded with them; otherwise it goes into the history at once.
        """
        running = self.__dict__.get("_step_102")
        if running is not None:
            running[1][step] = value
        else:
            self._record_written(step, value)

    @property
    def output(self) -> collections.defaultdict:
        """``{step: value}`` of everything recorded under this quantity's key.

        cockpit-for-pytorch 1.0.2's ``output`` (which ``get_output`` returns): one
        ``defaultdict(dict)`` per quantity, with the values as
        :meth:`cockpit.Cockpit.get_output` holds them (histograms as numpy
        arrays), refilled when the history changed. A value written into it
        (``self.output[step] = value``, as a 1.0.2 ``track`` does) is recorded:
        during the cockpit's step as one of the step's results, otherwise at once.
        """
        output = self.__dict__.get("_output")
        if not isinstance(output, QuantityOutput):
            output = self.__dict__["_output"] = QuantityOutput(self._output_written)
        history = self._history
        # values written show at once (the object holds them); refilled when the
        # history changed, with the values written but not yet recorded on top
        stamp = (id(history), None if history is None else history.revision)
        if output.stamp != stamp:
            items = dict(zip(*history.output_series(self.key))) if history else {}
            running = self.__dict__.get("_step_102")
            items.update(self.__dict__.get("_unsent", {}))
            items.update(running[1] if running else {})
            output.refill(items, stamp)
        return output

    @output.setter
    def output(self, value) -> None:
        """1.0.2 subclasses assign ``self.output = defaultdict(dict)``: accepted.

        The quantity keeps its own :attr:`output`; the entries of ``value`` are
        written into it.
        """
        for step, entry in dict(value).items():
            self.output[step] = entry

    def get_output(self) -> dict[int, Any]:
        """Return :attr:`output` (cockpit-for-pytorch 1.0.2's accessor)."""
        return self.output


class Cache102:
    """1.0.2's cache of ``TwoStepQuantity`` and its order of tracking (start, end).

    For two-step quantities written against 1.0.2
    (``_compute_start(global_step, params, batch_loss)``); the cockpit's own keep
    their state between the steps themselves.
    """

    def save_to_cache(
        self, global_step: int, key: str, value: Any, block_fn: Callable[[int], bool]
    ) -> None:
        """Keep ``value`` while ``block_fn(step)`` is true for the coming steps."""
        self._cache.setdefault(global_step, {})[key] = (value, block_fn)

    def load_from_cache(self, global_step: int, key: str) -> Any:
        """Return a value stored by :meth:`save_to_cache`.

        Raises:
            KeyError: If nothing is cached under ``(global_step, key)``.
        """
        try:
            return self._cache[global_step][key][0]
        except KeyError:
            raise KeyError(
                f"{self.key}: nothing cached for step {global_step} and key {key!r}. "
                "Fix: save it with save_to_cache in _compute_start, with a block_fn "
                "that stays true until the step that loads it."
            ) from None

    def _evict(self, global_step: int) -> None:
        """Drop cached values whose ``block_fn`` is false for the next step."""
        for step in list(self._cache):
            entries = self._cache[step]
            for key in [
                k for k, (_, keep) in entries.items() if not keep(global_step + 1)
            ]:
                del entries[key]
            if not entries:
                del self._cache[step]

    def _track_legacy(self, global_step: int, ctx: TrackContext) -> list:
        params, loss = list(ctx.params), ctx.info.get("loss")
        results = []
        with self._tracked_as_102(ctx) as written:
            if self.is_start(global_step):  # 1.0.2's order: start, then end
                self._compute_start(global_step, params, loss)
            if self.is_end(global_step):
                value = self._compute_end(global_step, params, loss)
                results.append((global_step - self.SAVE_SHIFT, value))
        self._evict(global_step)
        return [*written_values(written), *results]
