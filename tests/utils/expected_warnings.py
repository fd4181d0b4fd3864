"""Warnings the suite's cases produce on purpose, each named once with why.

A module whose cases produce one of these adds its mark to ``pytestmark`` (or a case
to its decorators), so that the suite's output lists only warnings nobody expected.
Each filter matches one message (a regular expression matched at its start, ``.``
standing for a colon, which separates the filter's fields); where the warning is
the subject of a test, that test asserts it (``pytest.warns`` records whatever the
filters say).
"""

from __future__ import annotations

import pytest

COCKPIT = "cockpit.errors.CockpitWarning"


def _ignore(message: str, category: str = COCKPIT):
    return pytest.mark.filterwarnings(f"ignore:{message}:{category}")


#: The Hessian diagonal of the small test networks has entries <= 0, where TICDiag
#: is undefined: recorded as missing (asserted by
#: tests/quantities/test_curvature_instruments.py::test_tic).
TIC_HESSIAN_NOT_POSITIVE = _ignore(
    r"TICDiag has no value at step \d+. \d+ entries of the curvature diagonal"
)

#: Models BackPACK cannot form the Hessian diagonal of (BERT, FSDP2 shards, custom
#: containers, a GRU) get the GGN instead, with this notice (asserted by
#: tests/curvature/test_ggn_curvature.py).
GGN_FOR_HESSIAN = _ignore(
    r"(TICDiag(, HessTrace)?|HessTrace)(, TICTrace)?. BackPACK cannot form this model"
)

#: A GRU has no BackPACK curvature rule: TICDiag, which takes only an exact
#: diagonal, is missing where the GGN's would need more than its budget of
#: backward passes, as tests/distributed/test_distributed.py checks.
TIC_WITHOUT_CURVATURE_RULE = _ignore(
    r"(TICDiag, )?TICDiagGGN (have|has) no value at step \d+. BackPACK cannot compute"
)

#: ``.grad`` changed after the backward pass (clipping, a scaler, DDP's no_sync
#: joins): Alpha's replayed update is not the step taken, so Alpha is missing
#: (asserted by tests/step/test_lifetime.py).
ALPHA_GRAD_CHANGED = _ignore(
    r"Alpha has no value at step \d+. .grad of \d+ parameter", "UserWarning"
)

#: Gradient accumulation (Lightning, Hugging Face, the docs' recipe): the cockpit
#: tracks the first micro-batch, so Alpha is missing (asserted by the integration
#: tests of accumulation).
ALPHA_ACCUMULATION = _ignore(
    r"Alpha has no value at step \d+. (with (gradient_accumulation_steps|"
    r"accumulate_grad_batches)|the optimizer step used several micro-batches)",
    "UserWarning",
)

#: Synthetic runs whose gradients fall beyond a narrow histogram range (chosen so
#: to test the clamping) look like misscaled inputs to the live diagnosis (its
#: own tests: tests/diagnosis/test_diagnosis.py).
MISSCALED_LOOKALIKE = _ignore(r"cockpit diagnosis \[inputs_misscaled")

#: Logs damaged on purpose: the reader skips the bad lines and says so (asserted by
#: tests/log/test_crash_safe_log.py).
DAMAGED_LOG = _ignore(
    r"Skipped (the torn last record \(line \d+\)|line \d+) of the cockpit log"
)

#: A step with a NaN loss on purpose (asserted by tests/test_robustness.py).
NONFINITE_STEP = _ignore(r"Step \d+. the loss and the gradients are not finite")

#: PyTorch's notice for ``backward(create_graph=True)`` with gradients in ``.grad``,
#: what the cases that check ``create_graph`` quantities do.
CREATE_GRAPH_CYCLE = _ignore(
    r"Using backward\(\) with create_graph=True will create a reference cycle",
    "UserWarning",
)

#: ``backpack.extend`` hooks every module of a Hugging Face model, whose root
#: returns a ``ModelOutput``: PyTorch says that module's backward hook is not
#: called, which BackPACK does not need.
HF_ROOT_BACKWARD_HOOK = _ignore(
    "For backward hooks to be called, module output should be a Tensor",
    "UserWarning",
)

#: A dependency of the benchmarks (not cockpit, which never scripts) calls
#: ``torch.jit.script``, deprecated in torch 2.13.
JIT_SCRIPT_DEPRECATED = _ignore(
    "`torch.jit.script` is deprecated", "DeprecationWarning"
)

#: The tests' LightningModule has a ``validation_step`` for the runs that validate;
#: the others have no ``val_dataloader``, which Lightning points out.
LIGHTNING_NO_VAL = _ignore(
    "You defined a `validation_step` but have no `val_dataloader`", "UserWarning"
)

#: Lightning's notices about the tests' short runs: resuming from ``ckpt_path``
#: (the callbacks are passed again, as it asks) and fewer batches than its
#: logging interval (the cockpit logs every tracked step whatever that is).
LIGHTNING_SHORT_RUNS = [
    _ignore("Be aware that when using `ckpt_path`, callbacks", "UserWarning"),
    _ignore("The number of training batches", "UserWarning"),
]

#: Cases that freeze a block train the rest; the Cockpit says which parameters it
#: skips (asserted by tests/test_real_loops.py).
FROZEN_SKIPPED = _ignore(r"The Cockpit skips \d+ frozen parameter")

#: One process with only the engines that serve FSDP2 models (the reference of
#: tests/distributed/test_fsdp.py) forms no exact curvature diagonal beyond the
#: GGN's budget: TICDiag is missing there, as the test asserts.
TIC_WITHOUT_EXACT_DIAGONAL = _ignore(
    r"TICDiag has no value at step \d+. no engine forms curvature diagonals"
)
