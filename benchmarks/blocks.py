"""Building blocks: what the quantities are built on, in units of a plain pass.

A block is a BackPACK extension, cockpit's own per-sample gradients, per-sample
gradients by ``torch.func``, or a Hessian-vector product. Each is timed against a
plain forward+backward pass (no optimizer step) of the same model; it is the floor
under any quantity that needs it.
"""

from __future__ import annotations

#: The blocks a run can measure (``--configs`` accepts them with or without the
#: ``block:`` prefix).
BLOCKS = (
    "BatchGrad",
    "PerSampleGradients",
    "BatchL2Grad",
    "SumGradSquared",
    "DiagHessian",
    "DiagGGNExact",
    "DiagGGNMC",
    "vmap_grad",
    "HVP",
)
#: Prefix that marks a block in a spec (``block:HVP``).
PREFIX = "block:"


def is_block(spec: str) -> bool:
    """Whether ``spec`` names a building block."""
    return spec.startswith(PREFIX)


def runner(problem: str, block: str):
    """Return ``(baseline, block_fn, extra_fn)`` callables for a building block.

    ``baseline`` is a plain forward+backward pass (no optimizer step) on the plain
    model; the block runs the same pass with one BackPACK extension on the extended
    copy, or per-sample gradients by ``torch.func``, or (``HVP``) a ``create_graph``
    backward whose extra Hessian-vector product ``extra_fn`` is timed separately
    (``extra_fn`` is None for the other blocks).
    """
    import torch

    from benchmarks.problems import make

    bench = make(problem)
    plain_params = list(bench.plain.parameters())
    F = torch.nn.functional
    counter = {"plain": 0, "block": 0}

    def baseline():
        x, y = bench.batch(counter["plain"])
        counter["plain"] += 1
        for p in plain_params:
            p.grad = None
        F.cross_entropy(bench.plain(x), y).backward()

    def next_batch():
        batch = bench.batch(counter["block"])
        counter["block"] += 1
        return batch

    if block == "vmap_grad":
        return baseline, _vmap_grad(bench, plain_params, next_batch), None
    if block == "HVP":
        return (baseline, *_hvp(bench, plain_params, next_batch))
    return baseline, _extension(bench, block, next_batch), None


def _vmap_grad(bench, plain_params, next_batch):
    import torch
    from torch.func import functional_call, grad, vmap

    F = torch.nn.functional
    names = [n for n, _ in bench.plain.named_parameters()]

    def sample_loss(params, x, y):
        out = functional_call(bench.plain, dict(zip(names, params)), (x[None],))
        return F.cross_entropy(out, y[None])

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    def run_block():
        x, y = next_batch()
        grads = per_sample(tuple(p.detach() for p in plain_params), x, y)
        del grads

    return run_block


def _hvp(bench, plain_params, next_batch):
    import torch

    F = torch.nn.functional
    state = {}

    def run_block():
        x, y = next_batch()
        loss = F.cross_entropy(bench.plain(x), y)
        state["grads"] = torch.autograd.grad(loss, plain_params, create_graph=True)
        state["v"] = [torch.randn_like(p) for p in plain_params]

    def run_hvp():
        hv = torch.autograd.grad(state["grads"], plain_params, state["v"])
        del hv
        state.clear()

    return run_block, run_hvp


def _extension(bench, block, next_batch):
    from backpack import backpack, extensions
    from backpack.core.derivatives.convnd import weight_jac_t_save_memory

    from benchmarks import internals

    if block == "PerSampleGradients":
        extension = internals.per_sample_gradients()
    else:
        extension = getattr(extensions, block)()
    ext_params = list(bench.extended.parameters())

    def run_block():
        x, y = next_batch()
        for p in ext_params:
            p.grad = None
        loss = bench.loss_fn(bench.extended(x), y)
        with weight_jac_t_save_memory(True), backpack(extension):
            loss.backward()
        for p in ext_params:
            if hasattr(p, extension.savefield):
                delattr(p, extension.savefield)

    return run_block
