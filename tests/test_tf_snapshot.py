"""FusedSnapshot: one-call device-to-host snapshot of a rank's checkpoint share of TF variables."""
from __future__ import annotations

import gc
import logging
import types
import uuid

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from ckpt_service.manager import CheckpointManager, DeferredShare, prepare_share  # noqa: E402
from ckpt_service.plan import make_save_plan, spec_of  # noqa: E402
from hvd_transient.keras import snapshot as tf_snapshot  # noqa: E402
from hvd_transient.keras.callback import TransientCallback  # noqa: E402
from hvd_transient.keras.snapshot import (  # noqa: E402
    FAST_CALL_ENV,
    AliasedShare,
    FusedSnapshot,
    SnapshotPlanError,
    TensorSlice,
    assemble_pieces,
    direct_call,
    host_outputs,
    public_call,
)
from hvd_transient.keras.state import build_optimizer_slots, learning_rate_of, state_variables  # noqa: E402
from hvd_transient.testing.workloads import MODELS  # noqa: E402


def small_model() -> tf.keras.Model:
    tf.keras.utils.set_random_seed(0)
    model = MODELS["small_cnn"]()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    build_optimizer_slots(model)
    rng = np.random.default_rng(1)
    for var in state_variables(model).values():  # slots start at zero: give every element a distinct value
        if var.dtype.is_floating:
            var.assign(rng.standard_normal(var.shape).astype(var.dtype.as_numpy_dtype))
    return model


def mixed_variables() -> dict[str, tf.Variable]:
    rng = np.random.default_rng(2)
    variables = dict(state_variables(small_model()))  # float32 weights and slots, int64 iterations
    variables.update({
        "extra/half": tf.Variable(rng.standard_normal((33, 5)).astype(np.float16)),
        "extra/double": tf.Variable(rng.standard_normal(17)),
        "extra/mask": tf.Variable(rng.integers(0, 2, 301).astype(bool)),
        "extra/count": tf.Variable(np.arange(40, dtype=np.int32).reshape(8, 5)),
        "extra/complex": tf.Variable((rng.standard_normal(9) + 1j).astype(np.complex64)),
        "extra/scalar": tf.Variable(np.int64(7)),
        "extra/empty": tf.Variable(np.zeros((0, 3), np.float32)),
    })
    return variables


def plans(specs, world: int):
    """The default plan, and one whose small pieces cut through many variables."""
    yield make_save_plan(specs, world)
    yield make_save_plan(specs, world, piece_bytes=1024, chunk_bytes=256)


def arrays(taken) -> list[np.ndarray]:
    """What a share snapshot returned, as the arrays a save writes."""
    return list(taken.assemble() if isinstance(taken, DeferredShare) else taken)


#: both ways of calling the traced function: the public API (the default) and the direct runtime call
CALLS = pytest.mark.parametrize("fast_call", [False, True], ids=["public_call", "direct_call"])


def assert_same_bytes(got, want: list[np.ndarray]) -> None:
    got = arrays(got)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()


@CALLS
@pytest.mark.parametrize("deferred", [True, False], ids=["host_path", "device_path"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("make_variables", [lambda: state_variables(small_model()), mixed_variables],
                         ids=["small_cnn", "mixed_dtypes"])
def test_fused_share_equals_the_per_variable_share(world, make_variables, deferred, fast_call, caplog) -> None:
    variables = make_variables()
    fused = FusedSnapshot(variables, deferred=deferred, fast_call=fast_call)
    with caplog.at_level(logging.WARNING, logger="hvd_transient.keras.snapshot"):
        for plan in plans(list(fused.specs.values()), world):
            for rank in range(world):
                want = [flat for _, flat in prepare_share(plan, rank, variables)]
                assert_same_bytes(fused(plan, rank), want)
                assert_same_bytes(fused(plan, rank), want)  # the cached function
    assert "one by one" not in caplog.text, "every dtype of the plan should take the fused path"


@CALLS
@pytest.mark.parametrize("deferred", [True, False], ids=["host_path", "device_path"])
def test_snapshot_is_the_state_at_call_time(deferred, fast_call) -> None:
    model = small_model()
    variables = dict(state_variables(model))
    variables["whole"] = tf.Variable(np.arange(100_000, dtype=np.float32))  # a large one: returned as read
    # the last case's only piece is one whole variable: the graph's output is the variable's read
    cases = [(variables, 1, None), (variables, 2, 1024), ({"whole": variables["whole"]}, 1, None)]
    for chosen, world, piece_bytes in cases:
        fused = FusedSnapshot(chosen, deferred=deferred, fast_call=fast_call)
        plan = make_save_plan(list(fused.specs.values()), world, piece_bytes=piece_bytes, chunk_bytes=256)
        for rank in range(world):
            before = [flat for _, flat in prepare_share(plan, rank, chosen)]
            got = fused(plan, rank)
            assert isinstance(got, AliasedShare) == deferred
            # in-place updates after the call, before the host path assembles the pieces:
            # assign_add, assign and an optimizer step
            for var in chosen.values():
                if var.dtype == tf.float32:
                    var.assign_add(tf.ones_like(var))
            variables["whole"].assign(tf.zeros_like(variables["whole"]))
            model.optimizer.apply_gradients([(tf.ones_like(v), v) for v in model.trainable_variables])
            assert_same_bytes(got, before)


def test_variables_in_host_memory_take_the_host_path() -> None:
    fused = FusedSnapshot(state_variables(small_model()))
    assert fused.deferred  # this machine has no accelerator
    plan = make_save_plan(list(fused.specs.values()), 2)
    taken = fused(plan, 0)
    assert isinstance(taken, AliasedShare)
    taken.assemble()
    with pytest.raises(RuntimeError, match="already assembled"):
        taken.assemble()  # it let go of the variables' buffers the first time


def test_host_outputs_read_each_variable_once_small_ones_concatenated_per_dtype() -> None:
    specs = {name: spec_of(name, np.zeros(shape, dtype)) for name, shape, dtype in [
        ("a", (3, 4), np.float32), ("big", (10, 10), np.float32), ("n", (5,), np.int64), ("b", (2,), np.float32)]}
    layout = ((TensorSlice("a", 0, 12, True), TensorSlice("big", 0, 30, False)),
              (TensorSlice("big", 30, 100, False), TensorSlice("b", 0, 2, True)), (TensorSlice("n", 0, 5, True),))
    out = host_outputs(layout, specs, small_elements=50)
    assert out.outputs == (("a", "b"), ("n",), ("big",))
    assert out.concatenated == (True, True, False)
    assert out.where == {"a": (0, 0), "b": (0, 12), "n": (1, 0), "big": (2, 0)}
    flats = [np.arange(14, dtype=np.float32), np.arange(5), np.arange(100, dtype=np.float32) + 1000]
    pieces = assemble_pieces(flats, out, layout)
    np.testing.assert_array_equal(pieces[0], np.r_[np.arange(12), np.arange(1000, 1030)])
    np.testing.assert_array_equal(pieces[1], np.r_[np.arange(1030, 1100), 12, 13])
    assert pieces[2].dtype == np.int64 and pieces[2].tolist() == [0, 1, 2, 3, 4]
    pieces[0][:] = -1
    assert flats[0][0] == 0 and flats[2][0] == 1000  # the pieces are copies, not views of the outputs


def test_async_save_of_a_keras_model_through_the_fused_snapshot() -> None:
    model = small_model()
    variables = state_variables(model)
    expected = {name: var.numpy() for name, var in variables.items()}
    fused = FusedSnapshot(variables)
    with CheckpointManager(f"memory://{uuid.uuid4().hex}", chunk_bytes=1024) as mgr:
        assert mgr.save_async(5, fused.specs, {"epoch": 1}, snapshot=fused)
        for var in variables.values():  # the training step that follows the save
            var.assign_add(tf.ones_like(var))
        assert mgr.wait(timeout=60) is not None
        got = mgr.restore(expected={n: (a.shape, a.dtype) for n, a in expected.items()}).tensors
    for name, arr in expected.items():
        np.testing.assert_array_equal(got[name], arr, err_msg=name)


def test_traced_once_per_plan_and_rank(caplog) -> None:
    fused = FusedSnapshot(state_variables(small_model()))
    specs = list(fused.specs.values())
    with caplog.at_level(logging.INFO, logger="hvd_transient.keras.snapshot"):
        plan = make_save_plan(specs, 2, piece_bytes=1024)
        fused(plan, 0)
        fused(plan, 0)
        fused(make_save_plan(specs, 2, piece_bytes=1024), 0)  # an equal plan from elsewhere
        assert caplog.text.count("traced") == 1
        fused(plan, 1)
        assert caplog.text.count("traced") == 2


def test_falls_back_to_reading_one_by_one(monkeypatch, caplog) -> None:
    variables = mixed_variables()
    fused = FusedSnapshot(variables)

    def failing() -> list[tf.Tensor]:
        raise tf.errors.InvalidArgumentError(None, None, "no kernel for this dtype")

    monkeypatch.setattr(FusedSnapshot, "_build", lambda self, *args: failing)
    plan = make_save_plan(list(fused.specs.values()), 2, piece_bytes=1024)
    with caplog.at_level(logging.WARNING, logger="hvd_transient.keras.snapshot"):
        for rank in range(2):
            got = fused(plan, rank)
            assert_same_bytes(got, [flat for _, flat in prepare_share(plan, rank, variables)])
    assert "one by one" in caplog.text


@pytest.mark.parametrize("make_call", [public_call, direct_call], ids=["public_call", "direct_call"])
@pytest.mark.parametrize("executor", ["", tf_snapshot.HOST_EXECUTOR], ids=["default", "single_threaded"])
def test_a_call_gives_what_the_function_gives_and_keeps_it_alive(executor, make_call) -> None:
    a = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    b = tf.Variable(np.int64(4))
    function = tf.function(lambda: [tf.reshape(a.read_value(), [-1]), b + 1], autograph=False)
    call = make_call(function.get_concrete_function(), executor)
    del function
    gc.collect()  # the runtime would drop the traced function with its last Python reference
    got = call()
    assert got[0].numpy().tolist() == [0, 1, 2, 3, 4, 5] and int(got[1]) == 5
    a.assign_add(tf.ones_like(a))  # the captured handles are the variables': later calls see updates
    assert call()[0].numpy().tolist() == [1, 2, 3, 4, 5, 6]


def test_direct_call_without_the_runtime_internals_falls_back_to_the_public_call() -> None:
    class NotConcrete:  # no name, captured inputs or outputs to call the runtime with
        def __call__(self) -> list[tf.Tensor]:
            return [tf.constant(3)]

    assert int(direct_call(NotConcrete(), tf_snapshot.HOST_EXECUTOR)()[0]) == 3


def test_the_public_call_is_the_default_and_the_switch_turns_on_the_direct_one(monkeypatch) -> None:
    variables = state_variables(small_model())
    used: list[str] = []
    for name, make_call in (("public", public_call), ("direct", direct_call)):
        monkeypatch.setattr(tf_snapshot, f"{name}_call",
                            lambda f, e="", name=name, make_call=make_call: used.append(name) or make_call(f, e))
    plan = make_save_plan(list(FusedSnapshot(variables).specs.values()), 1)
    monkeypatch.delenv(FAST_CALL_ENV, raising=False)
    for value, switch, expected in ((None, None, "public"), ("1", None, "direct"), ("0", None, "public"),
                                    ("1", False, "public"), (None, True, "direct")):
        if value is not None:
            monkeypatch.setenv(FAST_CALL_ENV, value)
        used.clear()
        fused = FusedSnapshot(variables, fast_call=switch)
        assert fused.fast_call == (expected == "direct")
        assert_same_bytes(fused(plan, 0), [flat for _, flat in prepare_share(plan, 0, variables)])
        assert used == [expected], (value, switch)


@CALLS
def test_an_executor_that_refuses_the_function_falls_back_to_the_default_one(monkeypatch, caplog,
                                                                             fast_call) -> None:
    variables = mixed_variables()
    monkeypatch.setattr(tf_snapshot, "HOST_EXECUTOR", "NO_SUCH_EXECUTOR")
    fused = FusedSnapshot(variables, fast_call=fast_call)
    plan = make_save_plan(list(fused.specs.values()), 2, piece_bytes=1024)
    with caplog.at_level(logging.WARNING, logger="hvd_transient.keras.snapshot"):
        for rank in range(2):
            assert_same_bytes(fused(plan, rank), [flat for _, flat in prepare_share(plan, rank, variables)])
    assert "using TensorFlow's default executor" in caplog.text  # the host path asked for the executor
    assert "one by one" not in caplog.text


def test_a_plan_of_other_tensors_is_refused() -> None:
    fused = FusedSnapshot(state_variables(small_model()))
    other = make_save_plan([*fused.specs.values()][:-1], 1)
    with pytest.raises(SnapshotPlanError, match="not made from this snapshot's variables"):
        fused(other, 0)


def test_callback_reuses_the_snapshot_while_the_variables_stay_the_same() -> None:
    model = small_model()
    callback = TransientCallback(None, store=f"memory://{uuid.uuid4().hex}", watcher="local")
    callback.set_model(model)
    first = callback.trainee.fused()
    assert callback.trainee.specs() is first.specs
    callback.trainee.fits += 1  # a new fit of the same model keeps its traced functions
    assert callback.trainee.fused() is first
    plan = make_save_plan(list(first.specs.values()), 1)
    assert_same_bytes(callback.trainee.share(plan, 0),
                      [flat for _, flat in prepare_share(plan, 0, state_variables(model))])


def test_the_save_metadata_has_the_learning_rate_when_it_is_a_variable() -> None:
    model = small_model()
    callback = TransientCallback(None, store=f"memory://{uuid.uuid4().hex}", watcher="local")
    callback.set_model(model)
    assert learning_rate_of(model.optimizer) == pytest.approx(0.1)
    assert callback.session.metadata(7) == {"step": 7, "world_size": 1, "lr": pytest.approx(0.1)}
    schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    assert learning_rate_of(tf.keras.optimizers.SGD(schedule)) == pytest.approx(0.1)  # its current value
    assert learning_rate_of(types.SimpleNamespace(learning_rate=0.5)) is None  # not a variable: not read
    assert learning_rate_of(object()) is None
