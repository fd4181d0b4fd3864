"""Elementwise sums of a ``fully_shard`` model, reduce-scattered unit by unit.

A quantity such as MeanGSNR forms, in each parameter's hook, this process's
elementwise sums over its samples (``sum_i g_i^2``, the full parameter's shape;
TICDiag's two; the channels, ``Quantity.sums_in_backward``)
and reduces it on its rows of the joined sum. Kept until the step's bucket, these
sums would hold ``D`` numbers each on every process. :class:`UnitSums` sends them
as FSDP does the gradient: when a unit's backward pass ends (FSDP's
post-backward of each parameter group, wrapped while the user's backward pass
runs), one reduce-scatter of that unit's sums; each process keeps only its rows.

Collectives inside the backward pass must be made by every process, in the same
order, or not at all:

* every process wraps the same groups and FSDP runs their post-backward in the
  same order (its own reduce-scatter there relies on it), once each (a group
  already sent is not sent again);
* each unit sends, for every channel and every parameter of the unit, the sum
  this process formed or zeros where its hooks formed none;
* the step's header is waited for first (its plan names the channels, so the
  claim and the header catch processes that differ); if that or a reduce-scatter
  fails, the failure is kept, no further collective is made in the backward pass
  (so the processes' FSDP collectives stay matched), and it is raised after the
  backward pass; a failure of this process only is told to the others at once;
* a sum formed after its unit was sent (zero results of a parameter the backward
  pass did not reach, shown after it; a hook later than FSDP's post-backward)
  is sent after the backward pass, on every process alike (a flag per parameter,
  summed in the bucket, says which go in a next round).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from cockpit.precision import compute_dtype

#: What cockpit's communicator calls these collectives.
WHAT = "the elementwise sums of a unit"


class UnitSums:
    """This step's elementwise sums, sent unit by unit (see the module).

    Args:
        comm: The step (:class:`cockpit.distributed.step.StepComm`).
        sharding: The layout (:class:`cockpit.distributed.sharded.Sharding`).
        channels: One name per sum a parameter has (``Quantity.channel``), the
            same on every process.
    """

    def __init__(self, comm, sharding, channels):
        self.comm = comm
        self.sharding = sharding
        self.channels = sorted(set(channels))
        self._pending: dict[tuple[str, int], Tensor] = {}
        self._late: dict[tuple[str, int], Tensor] = {}
        self._received: dict[tuple[str, int], Tensor] = {}
        self._sent: set[int] = set()
        self._formed: set[tuple[str, int]] = set()
        self._wrapped: list = []
        self._delivering: dict[str, list[Callable[[int, Tensor], None]]] = {}
        #: The failure of a collective in the backward pass, raised after it.
        self.broken: BaseException | None = None

    def carries(self, channel: str) -> bool:
        """Whether ``channel``'s sums go through here."""
        return channel in self.channels

    def put(self, channel: str, index: int, tensor: Tensor) -> None:
        """Parameter ``index``'s sum for ``channel``, sent with its unit.

        After a failure nothing more is kept (the step raises after the
        backward pass). A common channel's sum comes once per reader (the same
        values): one sent already is not sent again.
        """
        if self.broken is not None:
            return
        key = (channel, index)
        if key in self._formed and index in self._sent:
            return
        self._formed.add(key)
        if index in self._sent:
            self._late[key] = tensor
        else:
            self._pending[key] = tensor

    # --- during the user's backward pass -----------------------------------------
    def arm(self) -> None:
        """Send each unit's sums when FSDP's post-backward of its group ran."""
        index_of = {id(s.record): i for i, s in enumerate(self.sharding.shards)}
        for state in self.sharding._states():
            for group in state._fsdp_param_groups:
                indices = sorted(
                    index_of[id(record)]
                    for record in group.fsdp_params
                    if id(record) in index_of
                )
                if not indices:
                    continue
                missing = object()
                before = group.__dict__.get("post_backward", missing)
                wrapper = self._wrap(group.post_backward, indices)
                group.post_backward = wrapper
                self._wrapped.append((group, before, wrapper, missing))

    def disarm(self) -> None:
        """Give FSDP its post-backward back (whatever happened).

        Only where this step's wrapper is still in place (what was there before
        is put back); a wrapper someone kept sends nothing once disarmed.
        """
        self._armed = False
        for group, before, wrapper, missing in self._wrapped:
            if group.__dict__.get("post_backward") is wrapper:
                if before is missing:
                    del group.post_backward
                else:
                    group.post_backward = before
        self._wrapped = []

    def _wrap(self, post_backward: Callable, indices: list[int]) -> Callable:
        self._armed = True

        def sent_after(*args, **kwargs):
            out = post_backward(*args, **kwargs)
            if self._armed:
                self.send(indices)
            return out

        return sent_after

    def send(self, indices) -> None:
        """One reduce-scatter of the sums of ``indices`` not sent yet.

        A failure is kept (raised after the backward pass, so that FSDP's own
        collectives stay matched); one of this process only is told to the
        others at once, whose waits then fail too.
        """
        todo = [index for index in indices if index not in self._sent]
        if not todo:
            return
        self._sent.update(todo)
        if self.broken is not None:
            return
        try:
            self.comm.settle()  # (the header names the channels: all agree)
            self._scatter(todo)
        except Exception as error:  # raised after the backward pass
            self.broken = error
            self._pending.clear()
            self.comm.communicator.left(self.comm.global_step, error)

    def _scatter(self, indices) -> None:
        """Reduce-scatter the pending sums of ``indices`` (zeros where none)."""
        from cockpit.distributed.step import Bucket

        bucket = Bucket(self.comm)
        slots = []
        for index in indices:
            for channel in self.channels:
                tensor = self._pending.pop((channel, index), None)
                slots.append(((channel, index), self._add(bucket, index, tensor)))
                tensor = None  # (the bucket lets it go once packed)
        bucket.reduce(WHAT)
        for key, slot in slots:
            self._received[key] = slot.value

    def _add(self, bucket, index: int, tensor: Tensor | None, then=None):
        """Add a sum to ``bucket`` in the dtype every process sends for ``index``.

        ``None``: zeros (no sum formed here), never allocated.
        """
        dtype = compute_dtype(self.sharding.params[index].dtype)
        if tensor is None:
            return bucket.zero_rows(index, dtype, self._device, then)
        return bucket.rows(tensor.to(dtype), index, then)

    @property
    def _device(self) -> torch.device:
        from cockpit.distributed.sharded import local

        return local(self.sharding.params[0]).device

    # --- after the backward pass --------------------------------------------------
    def finish(self) -> None:
        """Send the units FSDP did not post-process; raise a failure kept.

        Every process calls it after the backward pass, with the same units left.
        """
        self.disarm()
        if self.broken is not None:
            raise self.broken
        self.send(range(len(self.sharding.params)))
        if self.broken is not None:
            raise self.broken

    def deliver(
        self, channel: str, bucket, then: Callable[[int, Tensor], None]
    ) -> None:
        """``then(index, rows)`` for every parameter, with the bucket's reduce.

        ``rows``: this process's rows of ``channel``'s sum over the processes
        (the same tensor for every reader of a common channel: read, not
        changed).
        Sums formed after their unit was sent, on any process (a parameter the
        backward pass did not reach, shown zero results after it; a hook later
        than FSDP's post-backward), are reduce-scattered in a next round of the
        bucket, on every process alike: which parameters have one is summed in
        the bucket (one number per parameter) and read on the host, once per
        step.
        """
        first = not self._delivering
        self._delivering.setdefault(channel, []).append(then)
        if not first:
            return
        flags = torch.zeros(
            len(self.sharding.params), dtype=torch.float64, device=self._device
        )
        for _, index in self._late:
            flags[index] = 1
        bucket.sum(flags, lambda total: self._delivered(bucket, total.tolist()))

    def _delivered(self, bucket, late: list[float]) -> None:
        """Hand each parameter's rows on; first the late sums' round, if any.

        The late round carries, for every parameter some process formed a late
        sum of, every channel's (zeros where this process has none), delivered
        or not, so that every process adds the same slots.
        """
        for channel in self.channels:
            readers = self._delivering.get(channel, [])  # (a common sum: several)
            for index, flagged in enumerate(late):
                early = self._received.pop((channel, index))
                if not flagged:
                    for then in readers:
                        then(index, early)
                    continue
                tensor = self._late.pop((channel, index), None)

                def joined(value, index=index, early=early, readers=readers):
                    total = early + value.to(early.dtype)
                    for then in readers:
                        then(index, total)

                self._add(bucket, index, tensor, joined)
