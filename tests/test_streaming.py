"""``qgraph.runtime.streaming``: recurrent models run with their own state fed back, sequences found from the data."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from qgraph import PassError
from qgraph.runtime.streaming import OutputScore, Recurrence, check_recurrence, run_streamed, sequence_starts
from qgraph.testing.recurrent import LEAKY_STATE, leaky_feeds, leaky_state_net

REC = Recurrence(state_inputs=LEAKY_STATE)


def _session(leak: float = 0.95) -> ort.InferenceSession:
    return ort.InferenceSession(leaky_state_net(leak=leak).SerializeToString(), providers=["CPUExecutionProvider"])


def _chunk(session: ort.InferenceSession, feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    return [dict(zip(["y", "s_next"], session.run(["y", "s_next"], f), strict=True)) for f in feeds]


def test_sequences_restart_where_the_recorded_state_is_not_the_previous_output() -> None:
    feeds = leaky_feeds(3, 5)
    assert sequence_starts(REC, feeds, _chunk(_session(), feeds)) == [0, 5, 10]
    assert sequence_starts(REC.model_copy(update={"sequence_length": 4}), feeds, []) == [0, 4, 8, 12]
    shuffled = [feeds[i] for i in (0, 2, 1, 3)]  # states no longer continue each other
    assert sequence_starts(REC, shuffled, _chunk(_session(), shuffled)) == [0, 1, 2, 3]


def test_the_float_model_streamed_on_its_own_recorded_data_reproduces_it() -> None:
    """Data recorded by streaming the float model: streamed, each step's state is the recorded one."""
    feeds = leaky_feeds(2, 6)
    out = run_streamed(_session(), ["y"], feeds, [0, 6], REC)
    for t in range(1, 12):
        if t != 6:
            np.testing.assert_allclose(out[t - 1]["s_next"], feeds[t]["s"], rtol=1e-6, atol=1e-7)


def test_streamed_error_accumulates_through_the_state_and_the_score_says_so() -> None:
    """A candidate whose state leaks slower: per step (recorded states) its error is small, streamed it grows."""
    feeds = leaky_feeds(2, 32)
    chunk, streamed = OutputScore(_session(), feeds), OutputScore(_session(), feeds, REC)
    assert not chunk.streamed and streamed.streamed and streamed.starts == [0, 32]
    candidate = _session(leak=0.96)
    per_step, own_state = chunk.score_db(candidate), streamed.score_db(candidate)
    assert own_state < per_step - 6, (per_step, own_state)
    assert "streamed over 2 sequence(s) of 64 samples" in streamed.describe()
    assert streamed.score_db(_session()) == float("inf")  # the reference itself: no error


def test_states_not_recorded_from_the_model_score_chunk_wise_and_say_so() -> None:
    rng = np.random.default_rng(0)
    feeds = [{"x": f["x"], "s": rng.standard_normal((1, 8)).astype(np.float32)} for f in leaky_feeds(1, 8)]
    score = OutputScore(_session(), feeds, REC)
    assert not score.streamed and "so chunk-wise" in score.describe()
    assert score.score_db(_session(0.96)) == pytest.approx(OutputScore(_session(), feeds).score_db(_session(0.96)))


def test_nan_outputs_never_read_as_no_error() -> None:
    score = OutputScore(_session(), leaky_feeds(1, 4), REC)
    assert score.score_db(_session(leak=float("nan"))) == float("-inf")


@pytest.mark.parametrize(("mapping", "message"), [
    ({"state": "s_next"}, r"names input 'state', which the model does not take; its inputs are \['s', 'x'\]"),
    ({"s": "stateN"}, r"maps 's' to output 'stateN', which the model does not produce; its outputs are"),
    ({"s": "y"}, None),  # same shape and type: accepted
])
def test_bad_mappings_name_the_tensor_and_the_fix(mapping: dict[str, str], message: str | None) -> None:
    rec = Recurrence(state_inputs=mapping)
    if message is None:
        check_recurrence(rec, leaky_state_net(), "who")
        return
    with pytest.raises(PassError, match=message) as info:
        check_recurrence(rec, leaky_state_net(), "who")
    assert "state_inputs: {state: stateN}" in str(info.value)


def test_a_state_of_another_shape_is_refused() -> None:
    model = leaky_state_net()
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 3
    with pytest.raises(PassError, match=r"'s' \(FLOAT \[1, 8\]\) cannot take output 'y' \(FLOAT \[1, 3\]\)"):
        check_recurrence(Recurrence(state_inputs={"s": "y"}), model, "who")
