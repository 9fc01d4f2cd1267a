"""Bad input, tried systematically (hypothesis): every argument of observe(), observe_eval(),
clip_grad_norm_() and measure_gradients() over every form a value takes in training code.

The contract: a programming error (a wrong type, a wrong shape, a bad setting) raises a
TypeError or ValueError naming the argument at the first call, before anything is recorded;
a data anomaly (NaN, +-Inf, huge, tiny, zero, steps going backwards) never raises and is
counted and exported.

``HYPOTHESIS_PROFILE=thorough`` tries 4x more cases; ``LOSSBEAT_PROPERTY_COUNTS=FILE``
writes the number of cases tried per property (docs/reliability.md quotes them).
"""

from __future__ import annotations

import collections
import copy
import fractions
import json
import math
import os
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from lossbeat import Monitor, MonitorConfig

settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

CASES: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _record_counts():
    yield
    path = os.environ.get("LOSSBEAT_PROPERTY_COUNTS")
    if path:
        with open(path, "w") as fh:
            json.dump({**CASES, "total": sum(CASES.values())}, fh, indent=1)


def monitor() -> Monitor:
    return Monitor(MonitorConfig(port=0, log_status_changes=False), serve=False, registry=CollectorRegistry())


def sample(m: Monitor, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {"rank": "0", "run_id": m.state.run_id, **labels})


def errors(m: Monitor) -> int:
    return sum(m.state.errors.values())


# --- values -----------------------------------------------------------------------------------
# A case is (description, value, expected float or None for "a programming error").

FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            0.0,
            -0.0,
            5e-324,
            1e-45,
            1e-300,
            1e300,
            1.7976931348623157e308,
            65504.0,
            65520.0,
            3.4e38,
            math.nan,
            math.inf,
            -math.inf,
            1.0,
            2.5,
        ]
    ),
)
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@st.composite
def data_values(draw):
    """A real number in a form training code passes: the value is data, never an error."""
    x = draw(FLOATS)
    form = draw(
        st.sampled_from(
            [
                "float",
                "int",
                "bigint",
                "numpy",
                "numpy-int",
                "fraction",
                "tensor",
                "tensor-1",
                "grad-leaf",
                "grad-nonleaf",
                "int-tensor",
            ]
        )
    )
    if form == "float":
        return form, x, x
    if form in ("int", "bigint", "numpy-int", "int-tensor"):
        bound = {"int": 2**63, "bigint": 2**2000, "numpy-int": 2**62, "int-tensor": 2**62}[form]
        n = draw(st.integers(-bound, bound))
        value = np.int64(n) if form == "numpy-int" else torch.tensor(n) if form == "int-tensor" else n
        try:
            expected = float(n) if form != "int-tensor" else float(torch.tensor(n).double())
        except OverflowError:
            expected = math.inf if n > 0 else -math.inf
        return form, value, expected
    if form == "numpy":
        value = draw(st.sampled_from([np.float16, np.float32, np.float64]))(x)
        return f"numpy-{value.dtype}", value, float(value)
    if form == "fraction":
        if not math.isfinite(x):
            return "float", x, x
        return form, fractions.Fraction(x), x
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    t = torch.tensor(x, dtype=dtype)
    if form == "tensor-1":
        t = t.reshape(1)
    elif form == "grad-leaf":
        t = t.clone().requires_grad_(True)
    elif form == "grad-nonleaf":
        t = t.clone().requires_grad_(True) * 1.0
    return f"{form}-{dtype}", t, float(t.detach().double())


_WRONG_TYPES = [
    ("str", "1.0"),
    ("bytes", b"1"),
    ("list", [1.0]),
    ("tuple", (1.0,)),
    ("dict", {"loss": 1.0}),
    ("bool", True),
    ("complex", 1 + 2j),
    ("object", object()),
    ("numpy-array", np.array([1.0, 2.0])),
    ("bool-tensor", torch.tensor(True)),
    ("complex-tensor", torch.tensor(1 + 2j)),
    ("meta", torch.tensor(1.0, device="meta")),
    ("set", {1.0}),
    ("none-list", [None]),
]
# Real tensors of another shape: a wrong value for most arguments, but per-step data for a loss
# or a loss component (nn.DataParallel's per-device losses): observed as the mean, counted.
_SHAPES = [("vector", torch.tensor([1.0, 2.0])), ("empty", torch.zeros(0)), ("matrix", torch.ones(2, 2))]
WRONG = st.sampled_from(_WRONG_TYPES + _SHAPES)
WRONG_TYPES = st.sampled_from(_WRONG_TYPES)
SHAPES = st.sampled_from(_SHAPES)


def observed(m: Monitor) -> tuple[float, float, int]:
    return m.state.steps_total, m.state.nonfinite_loss_total, errors(m)


def assert_names(exc: BaseException, name: str) -> None:
    assert isinstance(exc, (TypeError, ValueError)), f"{type(exc).__name__}: {exc}"
    assert str(exc).startswith(name), f"the error must name {name!r}: {exc}"


# --- observe(loss=...) ---------------------------------------------------------------------------


def test_loss_data_is_counted_never_raised():
    m = monitor()

    @given(case=data_values())
    def check(case):
        CASES["observe(loss=data)"] += 1
        _, value, expected = case
        steps, nonfinite, errs = observed(m)
        m.observe(7, loss=value)
        assert m.state.steps_total == steps + 1
        assert m.state.nonfinite_loss_total == nonfinite + (not math.isfinite(expected))
        assert errors(m) == errs
        exported = sample(m, "training_loss")
        if math.isfinite(expected):
            assert exported == expected
        else:
            assert math.isnan(exported)

    check()


def test_wrong_loss_types_raise_naming_loss_and_record_nothing():
    m = monitor()

    @given(case=WRONG_TYPES)  # None is no error: a rank without a loss (tests/test_stage_without_loss.py)
    def check(case):
        CASES["observe(loss=wrong)"] += 1
        before = observed(m)
        with pytest.raises((TypeError, ValueError)) as info:
            m.observe(1, loss=case[1])
        assert_names(info.value, "loss")
        assert observed(m) == before

    check()


@pytest.mark.parametrize("argument", ["loss", "losses"])
def test_a_loss_tensor_of_another_shape_is_counted_never_raised(argument):
    m = monitor()

    @given(case=SHAPES)
    def check(case):
        CASES[f"observe({argument}=shape)"] += 1
        steps, inputs = m.state.steps_total, m.state.errors.get("input", 0)
        m.observe(1, **({"loss": case[1]} if argument == "loss" else {"loss": 1.0, "losses": {"aux": case[1]}}))
        assert m.state.steps_total == steps + 1 and m.state.errors.get("input", 0) == inputs + 1

    check()


@pytest.mark.parametrize("argument", ["grad_norm", "tokens", "learning_rate", "losses", "epoch"])
def test_other_scalar_arguments(argument):
    """Each optional scalar: data values are recorded, wrong ones raise naming the argument."""
    m = monitor()

    def call(value):
        kwargs = {argument: {"aux": value} if argument == "losses" else value}
        m.observe(3, loss=1.0, **kwargs)

    @given(case=data_values())
    def data(case):
        CASES[f"observe({argument}=data)"] += 1
        _, value, expected = case
        if argument == "epoch" and isinstance(value, torch.Tensor):
            return  # epoch is a plain number (see the wrong-types property)
        errs, steps = errors(m), m.state.steps_total
        call(value)
        assert m.state.steps_total == steps + 1 and errors(m) == errs
        exported = {
            "grad_norm": lambda: sample(m, "training_grad_norm"),
            "learning_rate": lambda: sample(m, "training_learning_rate", param_group="0"),
            "losses": lambda: sample(m, "training_loss_component", component="aux"),
            "epoch": lambda: sample(m, "training_epoch"),
            "tokens": lambda: None,
        }[argument]()
        if argument in ("grad_norm", "losses"):
            assert exported == expected if math.isfinite(expected) else math.isnan(exported)
        elif argument == "learning_rate":
            assert exported == expected or (math.isnan(exported) and math.isnan(expected))
        elif argument == "epoch" and math.isfinite(expected):
            assert exported == expected

    data()

    @given(case=WRONG_TYPES if argument == "losses" else WRONG)
    def wrong(case):
        CASES[f"observe({argument}=wrong)"] += 1
        steps = m.state.steps_total
        with pytest.raises((TypeError, ValueError)) as info:
            call(case[1])
        name = {"losses": "losses['aux']"}.get(argument, argument)
        assert_names(info.value, name)
        assert m.state.steps_total == steps

    wrong()


def test_tokens_never_decrease_the_counter():
    m = monitor()

    @given(case=data_values())
    def check(case):
        CASES["observe(tokens) counter"] += 1
        before = sample(m, "training_tokens_total")
        m.observe(1, loss=1.0, tokens=case[1])
        after = sample(m, "training_tokens_total")
        assert after >= before and not math.isnan(after)

    check()


# --- steps ------------------------------------------------------------------------------------


def test_steps_backwards_repeating_and_jumping_are_data():
    m = monitor()
    ints = st.one_of(st.integers(-(2**63), 2**63), st.integers(0, 10).map(np.int64), st.integers(0, 10).map(np.int32))

    @given(steps=st.lists(ints, min_size=1, max_size=30))
    def check(steps):
        CASES["observe(step sequence)"] += 1
        total = m.state.steps_total
        for step in steps:
            m.observe(step, loss=1.0)
            assert sample(m, "training_step") == float(int(step))
        assert m.state.steps_total == total + len(steps)
        assert errors(m) == 0

    check()


def test_wrong_steps_raise_naming_step():
    m = monitor()

    @given(
        step=st.one_of(
            st.floats(), st.text(max_size=3), st.just(None), st.just(True), st.just(torch.tensor(3)), st.just([1])
        )
    )
    def check(step):
        CASES["observe(step=wrong)"] += 1
        for call in (lambda: m.observe(step, loss=1.0), lambda: m.observe_eval(step, 1.0)):
            with pytest.raises(TypeError) as info:
                call()
            assert_names(info.value, "step")
        assert m.state.steps_total == 0 and m.state.evals_total == 0

    check()


# --- observe_eval -----------------------------------------------------------------------------


def test_observe_eval():
    m = monitor()

    @given(case=st.one_of(data_values(), WRONG.map(lambda c: (c[0], c[1], None))))
    def check(case):
        CASES["observe_eval(eval_loss)"] += 1
        _, value, expected = case
        evals = m.state.evals_total
        if expected is None:
            with pytest.raises((TypeError, ValueError)) as info:
                m.observe_eval(5, value)
            assert_names(info.value, "eval_loss")
            assert m.state.evals_total == evals
            return
        m.observe_eval(5, value)
        assert m.state.evals_total == evals + 1 and errors(m) == 0
        exported = sample(m, "training_eval_loss")
        assert exported == expected if math.isfinite(expected) else math.isnan(exported)

    check()


# --- optimizers -------------------------------------------------------------------------------


@st.composite
def optimizers(draw):
    """Real torch optimizers with unusual param groups: names of any type, tensor LRs, no LR."""
    params = [torch.nn.Parameter(torch.randn(2)) for _ in range(draw(st.integers(1, 40)))]
    groups = []
    for p in params:
        group = {"params": [p]}
        name = draw(st.one_of(st.none(), st.text(max_size=8), st.integers(), st.just('a"b\\c\nd')))
        if name is not None:
            group["name"] = name
        groups.append(group)
    optimizer = torch.optim.SGD(groups, lr=draw(st.sampled_from([0.0, 1e-3, 1e-12, 10.0])))
    for group in optimizer.param_groups:
        kind = draw(st.sampled_from(["float", "tensor", "zero", "nan", "none"]))
        group["lr"] = {"float": 3e-4, "tensor": torch.tensor(3e-4), "zero": 0.0, "nan": math.nan, "none": None}[kind]
    return optimizer


def test_optimizers_with_unusual_param_groups():
    m = monitor()

    @given(optimizer=optimizers())
    def check(optimizer):
        CASES["observe(optimizer=...)"] += 1
        errs = errors(m)
        m.observe(1, loss=1.0, optimizer=optimizer)
        assert errors(m) == errs
        exported = [s for f in m.registry.collect() if f.name == "training_learning_rate" for s in f.samples]
        assert len(exported) <= 32  # bounded cardinality

    check()


@pytest.mark.parametrize(
    "optimizer, name",
    [
        (object(), "optimizer"),
        (type("Opt", (), {"param_groups": None})(), "optimizer"),
        (type("Opt", (), {"param_groups": [{"lr": "fast"}]})(), "optimizer.param_groups[0]['lr']"),
        (type("Opt", (), {"param_groups": [{"lr": torch.ones(3)}]})(), "optimizer.param_groups[0]['lr']"),
    ],
)
def test_wrong_optimizers_raise_naming_them(optimizer, name):
    m = monitor()
    with pytest.raises((TypeError, ValueError)) as info:
        m.observe(1, loss=1.0, optimizer=optimizer)
    assert_names(info.value, name)


# --- models: measure_gradients, clip_grad_norm_, observe(model=) ------------------------------


class Zoo(torch.nn.Module):
    """Frozen, unused and tied parameters, mixed dtypes."""

    def __init__(self, dtype: torch.dtype, frozen: bool, tied: bool) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 4, bias=False)
        self.mid = torch.nn.Linear(4, 4).to(dtype)
        self.out = torch.nn.Linear(4, 4, bias=False)
        self.unused = torch.nn.Linear(4, 4)
        if tied:
            self.out.weight = self.inp.weight
        if frozen:
            self.mid.requires_grad_(False)

    def forward(self, x):
        h = self.mid(self.inp(x).to(self.mid.weight.dtype)).float()
        return self.out(torch.tanh(h))


def reference_norm(model: torch.nn.Module) -> float:
    grads = {id(p): p.grad for p in model.parameters() if p.grad is not None}
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


@st.composite
def models(draw):
    torch.manual_seed(draw(st.integers(0, 2**16)))
    # fp16/bf16/fp32 mixes (fp64 gradients: see test_fp64_gradients below)
    model = Zoo(draw(st.sampled_from(FLOAT_DTYPES[:3])), draw(st.booleans()), draw(st.booleans()))
    scale = draw(st.sampled_from([1.0, 1e-30, 1e20, 0.0, math.nan, math.inf]))
    x = torch.randn(3, 4)
    if draw(st.booleans()):
        model(x).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
    return model, scale


FP32_SQUARE_MAX = 1.8e19


def close(a: float, b: float) -> bool:
    if math.isnan(b):
        return math.isnan(a)
    # Norms below ~1e-19 underflow to 0 when squared in fp32: both mean "vanished".
    return a == b or math.isclose(a, b, rel_tol=1e-2, abs_tol=1e-18)


def test_measure_gradients_and_observe_model():
    m = monitor()

    @given(case=models())
    def check(case):
        CASES["measure_gradients/observe(model)"] += 1
        model, _ = case
        errs = errors(m)
        expected = reference_norm(model)
        norm = m.measure_gradients(model)
        has_grads = any(p.grad is not None for p in model.parameters())
        assert (norm is None) == (not has_grads)
        if norm is not None:
            # Norms are accumulated in fp32 (gradients.py): above sqrt(fp32 max) a square overflows to inf.
            assert close(float(norm), expected) or (expected > FP32_SQUARE_MAX and math.isinf(float(norm))), (
                float(norm),
                expected,
            )
        m.observe(2, loss=1.0, model=model)
        assert errors(m) == errs
        if has_grads:
            exported = sample(m, "training_grad_norm")
            assert (
                close(exported, expected)
                or (math.isinf(expected) and math.isnan(exported))
                or (expected > FP32_SQUARE_MAX and math.isnan(exported))
            )

    check()


def test_clip_grad_norm_matches_torch():
    m = monitor()

    @given(case=models(), max_norm=st.one_of(st.floats(1e-6, 1e6), st.integers(1, 100), st.just(np.float32(0.5))))
    def check(case, max_norm):
        CASES["clip_grad_norm_"] += 1
        model, scale = case
        twin = copy.deepcopy(model)
        for p, q in zip(model.parameters(), twin.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        total = m.clip_grad_norm_(model, max_norm)
        assert errors(m) == 0
        if not any(p.grad is not None for p in twin.parameters()):
            assert float(total) == 0.0
            return
        expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), float(max_norm))
        if not math.isfinite(float(expected)):
            assert not math.isfinite(float(total))
            return
        assert close(float(total), float(expected)) or (
            float(expected) > FP32_SQUARE_MAX and math.isinf(float(total))
        ), (float(total), float(expected))
        for p, q in zip(model.parameters(), twin.parameters()):
            if q.grad is not None:
                assert torch.allclose(p.grad.float(), q.grad.float(), rtol=2e-2, atol=1e-6 * float(max_norm))

    check()


@pytest.mark.parametrize("max_norm", [0, -1.0, math.nan, None, "1.0", True, torch.tensor(1.0), [1.0]])
def test_clip_grad_norm_rejects_bad_max_norm(max_norm):
    m = monitor()
    with pytest.raises((TypeError, ValueError)) as info:
        m.clip_grad_norm_(torch.nn.Linear(2, 2), max_norm)
    assert_names(info.value, "max_norm")


@pytest.mark.parametrize("call", ["measure_gradients", "clip_grad_norm_", "observe"])
@pytest.mark.parametrize("model", [None, "model", object(), [torch.nn.Linear(2, 2)], torch.nn.Linear(2, 2).weight])
def test_wrong_models_raise_naming_model(call, model):
    m = monitor()
    with pytest.raises(TypeError) as info:
        {
            "measure_gradients": lambda: m.measure_gradients(model),
            "clip_grad_norm_": lambda: m.clip_grad_norm_(model, 1.0),
            "observe": lambda: m.observe(0, loss=1.0, model="x" if model is None else model),
        }[call]()
    assert_names(info.value, "model")


def sparse_model():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    model(torch.tensor([1, 2, 2])).sum().backward()
    return model


def test_sparse_gradients_never_reach_the_training_loop_from_measure_or_observe():
    m = monitor()
    model = sparse_model()
    m.measure_gradients(model)  # never raises: measured, or counted as an exporter error
    m.observe(0, loss=1.5, model=model)
    assert m.state.steps_total == 1 and sample(m, "training_loss") == 1.5  # the step counts all the same


def test_clip_grad_norm_with_sparse_gradients():
    m = monitor()
    model = sparse_model()
    dense = [(p.grad.to_dense() if p.grad.is_sparse else p.grad).clone() for p in model.parameters()]
    norm = m.clip_grad_norm_(model, 1.0)  # returns the norm before clipping, as torch's does
    assert close(float(norm), math.sqrt(sum(float(g.double().pow(2).sum()) for g in dense)))
    clipped = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in model.parameters()]
    assert close(math.sqrt(sum(float(g.double().pow(2).sum()) for g in clipped)), min(1.0, float(norm)))


def test_fp64_gradients():
    m = monitor()
    model = torch.nn.Linear(3, 3).double()
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    measured = m.measure_gradients(model)
    assert measured is not None and close(float(measured), expected)
    assert close(float(m.clip_grad_norm_(model, 1e9)), expected)


def test_error_messages_name_arguments_at_the_first_call():
    """A fresh monitor: the very first call with a mistake raises, and nothing is half-recorded."""
    for kwargs, name in [
        ({"loss": "1"}, "loss"),
        ({"loss": 1.0, "grad_norm": [1]}, "grad_norm"),
        ({"loss": 1.0, "losses": [1.0]}, "losses"),
        ({"loss": 1.0, "losses": {1: 1.0}}, "losses"),
        ({"loss": 1.0, "grad_scaler": object()}, "grad_scaler"),
        ({"loss": 1.0, "epoch": "1"}, "epoch"),
    ]:
        m = monitor()
        with pytest.raises((TypeError, ValueError)) as info:
            m.observe(0, **kwargs)
        assert_names(info.value, name)
        assert m.state.steps_total == 0 and re.match(r"^\w", str(info.value))
