"""cockpit.curvature.attention: fused attention whose backward pass differentiates.

While a quantity that needs Hessian-vector products belongs to a cockpit,
``F.scaled_dot_product_attention`` runs the same fused kernel forward and backward
(outputs and gradients bit for bit), and its ``create_graph`` backward recomputes
PyTorch's math attention, so Hessian-vector products equal those of a model run
with the math kernel throughout (float64). On main these products fail with
"derivative for ..._scaled_dot_product_flash_attention_for_cpu_backward is not
implemented".
"""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.curvature import attention
from cockpit.utils.schedules import linear

ORIGINAL = attention._ORIGINAL


@pytest.fixture
def held():
    """The wrapper installed for the test (a stand-in owner holds it)."""

    class Owner:
        pass

    owner = Owner()
    attention.hold(owner)
    yield
    del owner
    gc.collect()


def _inputs(dtype=torch.float64, gqa=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    heads_kv = 1 if gqa else 2
    query = torch.randn(3, 2, 5, 4, dtype=dtype, generator=gen)
    key = torch.randn(3, heads_kv, 6, 4, dtype=dtype, generator=gen)
    value = torch.randn(3, heads_kv, 6, 4, dtype=dtype, generator=gen)
    return [t.requires_grad_() for t in (query, key, value)]


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "scale": {"scale": 0.3},
    "gqa": {"enable_gqa": True},
    "bool mask": {"attn_mask": "bool"},
    "float mask": {"attn_mask": "float"},
}


def _options(name, gen_seed=1):
    options = dict(CASES[name])
    gen = torch.Generator().manual_seed(gen_seed)
    if options.get("attn_mask") == "bool":
        mask = torch.rand(5, 6, generator=gen) > 0.4
        mask[:, 0] = True
        options["attn_mask"] = mask
    elif options.get("attn_mask") == "float":
        bias = torch.randn(1, 2, 5, 6, dtype=torch.float64, generator=gen)
        options["attn_mask"] = bias.requires_grad_()
    return options


def _loss(fn, inputs, options):
    out = fn(*inputs, **options)
    return (out.sin() * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum()


def _sources(inputs, options):
    mask = options.get("attn_mask")
    extra = [mask] if isinstance(mask, torch.Tensor) and mask.requires_grad else []
    return inputs + extra


@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_are_the_fused_kernels(held, name):
    options = _options(name)
    inputs = _inputs(gqa=name == "gqa")
    sources = _sources(inputs, options)
    assert F.scaled_dot_product_attention is not ORIGINAL
    wrapped = F.scaled_dot_product_attention(*inputs, **options)
    assert wrapped.grad_fn is not None
    plain = ORIGINAL(*inputs, **options)
    assert torch.equal(wrapped, plain)
    got = torch.autograd.grad(_loss(F.scaled_dot_product_attention, inputs, options),
                              sources)  # fmt: skip
    want = torch.autograd.grad(_loss(ORIGINAL, inputs, options), sources)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("name", list(CASES))
def test_hessian_vector_products_equal_the_math_kernels(held, name):
    options = _options(name)
    inputs = _inputs(gqa=name == "gqa")
    sources = _sources(inputs, options)
    vectors = [torch.randn_like(s) for s in sources]

    def hvp(fn):
        grads = torch.autograd.grad(_loss(fn, inputs, options), sources,
                                    create_graph=True)  # fmt: skip
        return torch.autograd.grad(grads, sources, vectors)

    got = hvp(F.scaled_dot_product_attention)
    with sdpa_kernel(SDPBackend.MATH):
        want = hvp(ORIGINAL)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    if name != "float mask":  # a mask with a gradient takes the math kernel anyway
        with pytest.raises(RuntimeError, match="derivative for .* not implemented"):
            hvp(ORIGINAL)  # the fused kernel alone: what the wrapper fixes


def test_batched_backward_and_repeated_backward(held):
    """Per-sample gradients (is_grads_batched) and retain_graph keep working."""
    inputs = _inputs()
    out = F.scaled_dot_product_attention(*inputs, is_causal=True)
    losses = out.pow(2).flatten(1).sum(1)
    selector = torch.eye(3, dtype=torch.float64)
    (batched,) = torch.autograd.grad(losses, inputs[0], selector, retain_graph=True,
                                     is_grads_batched=True)  # fmt: skip
    for i in range(3):
        (single,) = torch.autograd.grad(losses[i], inputs[0], retain_graph=True)
        torch.testing.assert_close(batched[i], single, rtol=1e-12, atol=1e-14)
    first = torch.autograd.grad(losses.sum(), inputs, retain_graph=True)
    second = torch.autograd.grad(losses.sum(), inputs)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_calls_it_cannot_serve_go_to_pytorch_unchanged(held):
    query, key, value = _inputs()
    with torch.no_grad():  # no graph
        assert F.scaled_dot_product_attention(query, key, value).grad_fn is None
    detached = [t.detach() for t in (query, key, value)]
    assert F.scaled_dot_product_attention(*detached).grad_fn is None
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.5)
    assert "TwiceDifferentiable" not in type(out.grad_fn).__name__
    inside = torch.func.vmap(F.scaled_dot_product_attention)(query, key, value)
    assert torch.equal(inside, torch.func.vmap(ORIGINAL)(query, key, value))


def test_installed_while_a_curvature_quantity_lives():
    gc.collect()
    assert not attention.active()
    economy = Cockpit([torch.nn.Parameter(torch.zeros(2))], [Q.GradNorm(linear(1))])
    assert not attention.active()  # first-order only: PyTorch's function
    quantities = [Q.HessMaxEV(linear(1)), Q.HessTrace(linear(1))]
    cockpit = Cockpit([torch.nn.Parameter(torch.zeros(2))], quantities)
    assert attention.active()
    # the GGN needs no second derivative of the network: nothing installed for it
    ggn = Q.HessTrace(linear(1), curvature="diag_ggn_exact", key="GGN")
    Cockpit([torch.nn.Parameter(torch.zeros(2))], [ggn])
    del cockpit, quantities, economy
    gc.collect()
    assert not attention.active()
    assert F.scaled_dot_product_attention is ORIGINAL
