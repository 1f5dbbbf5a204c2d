"""The MQAR diagnosis (scripts/benchmarks/diagnose_recall.py): its layouts put each pair where they say, its oracle
hands memory review exactly the pair's cell and nothing else, and its measurements at initialisation run."""

import math

import pytest
import torch
from diagnose_recall import (
    FIRST_KEY,
    FIRST_VALUE,
    WINDOWS,
    build_model,
    evaluate,
    gradients_at_init,
    mqar_batch,
    oracle_cells,
    query_logits,
    sequence_length,
)


@pytest.mark.parametrize("layout", list(WINDOWS))
def test_each_query_asks_for_the_value_of_a_pair_in_the_window_named(layout):
    pairs = 4
    ids, positions, values, windows = mqar_batch(torch.Generator().manual_seed(0), 8, layout, pairs)
    assert ids.shape == (8, sequence_length(layout, pairs))
    window = WINDOWS[layout]
    for row in range(8):
        for query in range(pairs):
            key = ids[row, positions[query]]
            assert (
                FIRST_KEY <= key < FIRST_VALUE and ids[row, positions[query] + 1] == FIRST_VALUE + values[row, query]
            )
            pair_start = (ids[row, : positions[0]] == key).nonzero().flatten()
            assert len(pair_start) == 1, "each key is stored once, before the queries"
            assert ids[row, pair_start + 1] == FIRST_VALUE + values[row, query]
            assert pair_start.item() // window == windows[row, query]
            assert positions[query] // window > windows[row, query], "a query reads its pair only through a cell"
    if layout in ("packed", "spread"):  # every pair in the first window
        assert (windows == 0).all()
    else:
        assert sorted(windows[0].tolist()) == list(range(pairs))  # one pair per window


def test_spread_puts_filler_between_pairs_and_queries_at_any_length():
    ids, positions, _, windows = mqar_batch(torch.Generator().manual_seed(0), 2, "spread", 8, length=300)
    assert ids.shape == (2, 300) and positions.tolist() == list(range(300 - 16, 300, 2)) and (windows == 0).all()
    with pytest.raises(ValueError, match="too short"):
        sequence_length("spread", 8, length=20)


def test_spread_fills_as_many_windows_as_its_pairs_need():
    """16 pairs are 32 tokens: they fill the first two windows of 16, and no query shares a window with a pair."""
    ids, positions, values, windows = mqar_batch(torch.Generator().manual_seed(0), 3, "spread", 16, length=64)
    assert ids.shape == (3, 64) and positions.tolist() == list(range(32, 64, 2))
    assert sorted(windows[0].tolist()) == [0] * 8 + [1] * 8
    for row in range(3):
        for query in range(16):
            pair_start = (ids[row, :32] == ids[row, positions[query]]).nonzero().item()
            assert (
                pair_start // 16 == windows[row, query]
                and ids[row, pair_start + 1] == FIRST_VALUE + values[row, query]
            )
    with pytest.raises(ValueError, match="at least 64"):
        sequence_length("spread", 16, length=63)


@pytest.mark.parametrize("layout", ["no-filler", "one-per-window"])
def test_the_oracle_reads_exactly_the_pair_cell_and_leaves_other_tokens_alone(layout):
    pairs = 3
    length = sequence_length(layout, pairs)
    ids, positions, _, windows = mqar_batch(torch.Generator().manual_seed(1), 4, layout, pairs)
    torch.manual_seed(0)
    model = build_model("ran-oracle", layout, length).eval()
    cells = oracle_cells(4, length, positions, windows)
    with torch.no_grad():
        _, handed = query_logits(model, ids, positions, cells, output_attentions=True)
        _, plain = query_logits(model, ids, positions, None, output_attentions=True)
    rows = torch.arange(4)[:, None]
    for weights, plain_weights in zip(handed.memory_attentions, plain.memory_attentions):
        assert torch.allclose(weights[rows, positions, windows], torch.ones(4, pairs))
        assert torch.allclose(weights[rows, positions].sum(-1), torch.ones(4, pairs))
        others = torch.ones(length, dtype=torch.bool)
        others[positions] = False
        # Tokens before the first query read as they do without the oracle (later ones see changed states).
        before = torch.arange(length) < positions[0]
        assert torch.equal(weights[:, before & others], plain_weights[:, before & others])
        assert not torch.allclose(weights[rows, positions], plain_weights[rows, positions])


def test_the_oracle_needs_a_model_without_the_starting_cell():
    from diagnose_recall import install_oracle

    with pytest.raises(ValueError, match="review_initial_cell=False"):
        install_oracle(build_model("ran", "packed", 32))


def test_gradients_reach_memory_review_and_the_pair_cells_at_initialisation():
    result = gradients_at_init("no-filler", 4, batch_size=8)
    norms = result["gradient_norm"]
    assert all(math.isfinite(value) for value in norms.values())
    assert norms["memory_review"] > 0 and norms["window_attention_and_cell_write"] > 0
    for layer in result["layers"]:
        assert layer["cell_gradient_pair_windows"] > 0
        assert 0 < layer["review_on_pair_cell"] < 1 and 0 < layer["uniform_review_weight"] < 1


def test_plain_review_starts_uniform_and_token_keys_find_the_pair_cell_at_initialisation():
    """The diagnosis in one look: at initialisation a query weighs every earlier cell about alike, while scoring a
    cell by its window's tokens (`ran-token-keys`) puts most of the weight on the cell that holds the query's key."""
    ids, positions, _, windows = mqar_batch(torch.Generator().manual_seed(2), 8, "no-filler", 8)
    rows = torch.arange(8)[:, None]
    on_pair_cell = {}
    for name in ("ran", "ran-token-keys"):
        torch.manual_seed(0)
        model = build_model(name, "no-filler", sequence_length("no-filler", 8)).eval()
        with torch.no_grad():
            _, outputs = query_logits(model, ids, positions, None, output_attentions=True)
        on_pair_cell[name] = [w[rows, positions, windows + 1].mean().item() for w in outputs.memory_attentions]
    assert all(weight < 0.2 for weight in on_pair_cell["ran"]), on_pair_cell  # uniform over 9-16 cells: 0.06-0.11
    assert all(weight > 0.7 for weight in on_pair_cell["ran-token-keys"]), on_pair_cell


@pytest.mark.parametrize("name", ["llama", "gla"])
def test_the_anchors_train_and_are_scored(name):
    """The Llama (whose layers sit where a RAN's do, `model.layers`) and the GLA run through the same loop."""
    model = build_model(name, "packed", sequence_length("packed", 8))
    accuracy, on_pair_cell = evaluate(model, "packed", 8, examples=4)
    answers = 4 * 8  # 4 examples of 8 pairs: the accuracy is a whole number of them
    assert accuracy * answers == round(accuracy * answers) and on_pair_cell == []


def test_a_curriculum_over_lengths_trains_at_the_longer_length_from_its_step(monkeypatch):
    """`--later_length 48 --later_from 3`: steps 1-2 draw `spread` batches of --length tokens, steps 3-4 of 48."""
    import diagnose_recall

    drawn = []
    batch = diagnose_recall.mqar_batch

    def recording(generator, batch_size, layout, pairs, length=None):
        drawn.append(length)
        return batch(generator, batch_size, layout, pairs, length)

    monkeypatch.setattr(diagnose_recall, "mqar_batch", recording)
    args = diagnose_recall.parse_args(
        ["--experiments", "spread/ran-associative", "--steps", "4", "--batch_size", "2", "--length", "32",
         "--later_length", "48", "--later_from", "3", "--eval_every", "10", "--eval_lengths", "48"]
    )  # fmt: skip
    monkeypatch.setattr(diagnose_recall, "evaluate", lambda model, layout, pairs, length=None, **_: (0.0, []))
    result = diagnose_recall.train_once("spread/ran-associative", args, seed=0)
    assert drawn == [32, 32, 48, 48] and result.steps == 4


def test_arguments_too_short_for_the_most_pairs_asked_are_refused():
    """16 pairs in `spread` need 64 tokens (two windows of pairs, 32 tokens of queries): a 48-token length is named."""
    import diagnose_recall

    diagnose_recall.parse_args(["--experiments", "spread/ran-associative", "--length", "48", "--eval_lengths", "48"])
    with pytest.raises(SystemExit):
        diagnose_recall.parse_args(
            ["--experiments", "spread/ran-associative-p16", "--length", "48", "--eval_lengths", "64"]
        )
