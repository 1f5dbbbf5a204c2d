"""The benchmark baselines (scripts/benchmarks/baseline_models.py): padding invariance, slicing and enrichment,
losses, learning, argument checks and parameter counts, on tiny models."""

import math
import sys
from pathlib import Path

import pytest
import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "benchmarks"))  # also done by conftest.py
from baseline_models import (
    BiLSTMForSequenceClassification,
    BiLSTMForTokenClassification,
    SlicedRNNForSequenceClassification,
    baseline_for,
    count_parameters,
    slice_documents,
)


TOLERANCE = 1e-5
SIZES = {"vocab_size": 20, "embedding_size": 8, "hidden_size": 6, "num_labels": 3}

# Slices of 4 tokens, so the test lengths (up to 13) span several slices, some of them shorter than the enrichment.
MODELS = {
    "bilstm": lambda **kw: BiLSTMForSequenceClassification(**{**SIZES, **kw}),
    "bilstm-tokens": lambda **kw: BiLSTMForTokenClassification(**{**SIZES, **kw}),
    "srnn": lambda **kw: SlicedRNNForSequenceClassification(**{**SIZES, "slice_length": 4, **kw}),
    "bisrnn-all-poolings": lambda **kw: SlicedRNNForSequenceClassification(
        **{**SIZES, "slice_length": 4, "bidirectional": True, "poolings": ("max", "mean", "last"), **kw}
    ),
    "bpie-srnn": lambda **kw: SlicedRNNForSequenceClassification(
        **{**SIZES, "slice_length": 4, "enrichment": 2, **kw}
    ),
    "bpie-bisrnn": lambda **kw: baseline_for("bpie-bisrnn", **{**SIZES, "slice_length": 4, "enrichment": 3, **kw}),
}


def assert_close(actual, expected, what):
    diff = (actual - expected).abs().max().item()
    assert diff <= TOLERANCE, f"{what}: max abs diff {diff:.2e}"


@pytest.mark.parametrize("name", MODELS)
def test_padding_invariance(name):
    """A sequence in a right-padded batch gets the logits it gets alone; left padding too; a padding row is finite."""
    torch.manual_seed(0)
    model = MODELS[name](dropout=0.0).eval()
    lengths = [13, 4, 9, 8, 1, 5]  # several slices, whole slices, a short tail, a single token
    width = max(lengths) + 3
    ids = torch.randint(1, SIZES["vocab_size"], (len(lengths) + 1, width))
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    # The padding holds real token ids: only the mask may hide them. The last row is all padding.
    logits = model(ids, mask).logits
    assert torch.isfinite(logits).all()

    for row, length in enumerate(lengths):
        alone = model(ids[row : row + 1, :length]).logits
        batched = logits[row : row + 1, :length] if name == "bilstm-tokens" else logits[row : row + 1]
        assert_close(batched, alone, f"row {row}")
        left_ids = torch.cat([ids[row, length:], ids[row, :length]])[None]
        left_mask = torch.cat([mask[row, length:], mask[row, :length]])[None]
        left = model(left_ids, left_mask).logits
        assert_close(left[:, width - length :] if name == "bilstm-tokens" else left, alone, f"row {row}, left padded")


@pytest.mark.parametrize("name", MODELS)
def test_padding_row_trains(name):
    """A batch with a row of padding only gives a finite loss and finite gradients."""
    torch.manual_seed(0)
    model = MODELS[name]()
    ids = torch.randint(1, SIZES["vocab_size"], (2, 7))
    mask = torch.tensor([[1] * 7, [0] * 7])
    labels = torch.tensor([[1] * 7, [2] * 7]) if name == "bilstm-tokens" else torch.tensor([1, 2])
    loss = model(ids, mask, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_slice_positions():
    """Forward slice k reads [last m of slice k-1; slice k]; backward, [slice k; first m of slice k+1] reversed."""
    lengths = torch.tensor([10, 0, 3])
    forward = slice_documents(lengths, slice_length=4, enrichment=2)
    assert forward.document.tolist() == [0, 0, 0, 2]
    assert forward.number.tolist() == [0, 1, 2, 0]
    assert forward.positions.tolist() == [
        [0, 1, 2, 3, -1, -1],  # the first slice has no predecessor
        [2, 3, 4, 5, 6, 7],
        [6, 7, 8, 9, -1, -1],  # a short last slice
        [0, 1, 2, -1, -1, -1],  # the next document starts afresh
    ]
    assert forward.lengths.tolist() == [4, 6, 4, 3]
    assert forward.enrichment.tolist() == [0, 2, 2, 0]

    backward = slice_documents(lengths, slice_length=4, enrichment=2, reverse=True)
    assert backward.positions.tolist() == [
        [5, 4, 3, 2, 1, 0],
        [9, 8, 7, 6, 5, 4],
        [9, 8, -1, -1, -1, -1],  # the last slice has no successor
        [2, 1, 0, -1, -1, -1],
    ]
    assert backward.enrichment.tolist() == [2, 2, 0, 0]

    # Enrichment only as far as the next slice goes: one token left after slice 1.
    assert slice_documents(torch.tensor([9]), 4, 2, reverse=True).positions[1].tolist() == [8, 7, 6, 5, 4, -1]
    plain = slice_documents(torch.tensor([9]), 4)
    assert plain.positions.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, -1, -1, -1]]


def changed_slices(model, position):
    """Which slice representations r_k change when the token at `position` (of a 12-token document) changes."""
    torch.manual_seed(1)
    ids = torch.randint(1, SIZES["vocab_size"], (1, 12))
    edited = ids.clone()
    edited[0, position] = ids[0, position] % (SIZES["vocab_size"] - 1) + 1
    with torch.no_grad():
        before, _ = model.slice_representations(ids)
        after, _ = model.slice_representations(edited)
    return [k for k in range(len(before)) if not torch.allclose(before[k], after[k], atol=0, rtol=0)]


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("enrichment", [0, 1, 2])
def test_enrichment_reads_the_neighbouring_slices(bidirectional, enrichment):
    """Slices of 4 tokens: a token reaches a neighbouring r_k only as one of the m enrichment tokens it reads."""
    torch.manual_seed(0)
    model = SlicedRNNForSequenceClassification(
        **SIZES, slice_length=4, enrichment=enrichment, bidirectional=bidirectional, dropout=0.0
    ).eval()
    for position in range(12):
        own, offset = divmod(position, 4)
        expected = {own}
        if offset >= 4 - enrichment and own < 2:  # among the last m tokens: read forward by the next slice
            expected.add(own + 1)
        if bidirectional and offset < enrichment and own > 0:  # among the first m: read backward by the previous
            expected.add(own - 1)
        assert changed_slices(model, position) == sorted(expected), f"token {position}"


def pooled(outputs, last, poolings):
    features = {"max": outputs.amax(0), "mean": outputs.mean(0), "last": last}
    return torch.cat([features[name] for name in poolings])


def reference_logits(model, ids):
    """Algorithm 1 of the BPIE paper for one unpadded document, slice by slice (no zero padding at the ends)."""
    embeddings = model.embeddings(ids)[0]
    length, z, m, poolings = len(embeddings), model.slice_length, model.enrichment, model.poolings
    slices = []
    for start in range(0, length, z):
        end = min(start + z, length)
        first = max(start - m, 0)
        forward, _ = model.forward_gru(embeddings[None, first:end])
        forward = forward[0, start - first :]  # the enrichment outputs are dropped
        representation = [pooled(forward, forward[-1], poolings)]
        if model.bidirectional:
            after = min(end + m, length)
            backward, _ = model.backward_gru(embeddings[None, start:after].flip(1))
            backward = backward[0, after - end :]  # in reverse order: its last output is at the slice's first token
            representation.append(pooled(backward, backward[-1], poolings))
        slices.append(torch.cat(representation))
    outputs, _ = model.document_gru(torch.stack(slices)[None])
    outputs = outputs[0]
    hidden = model.document_gru.hidden_size
    # "last" is each direction's final state: the forward one after the last slice, the backward one after the first.
    last = torch.cat([outputs[-1, :hidden], outputs[0, hidden:]]) if model.bidirectional else outputs[-1]
    return model.classifier(pooled(outputs, last, poolings))


@pytest.mark.parametrize("name", ["srnn", "bisrnn-all-poolings", "bpie-srnn", "bpie-bisrnn"])
@pytest.mark.parametrize("length", [1, 4, 11, 13])
def test_sliced_rnn_matches_a_slice_by_slice_reference(name, length):
    torch.manual_seed(0)
    model = MODELS[name](dropout=0.0).eval()
    ids = torch.randint(1, SIZES["vocab_size"], (1, length))
    with torch.no_grad():
        assert_close(model(ids).logits[0], reference_logits(model, ids), f"{name}, {length} tokens")


def test_single_label_loss():
    torch.manual_seed(0)
    model = MODELS["bpie-bisrnn"]()
    ids, labels = torch.randint(1, 20, (4, 9)), torch.tensor([0, 2, 1, 2])
    output = model(ids, labels=labels)
    expected = -output.logits.log_softmax(-1).gather(1, labels[:, None]).mean()
    assert torch.allclose(output.loss, expected, atol=1e-6)


def test_multi_label_loss():
    torch.manual_seed(0)
    model = MODELS["bilstm"](problem_type="multi_label_classification")
    ids, labels = torch.randint(1, 20, (4, 9)), torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0]])
    output = model(ids, labels=labels)
    probabilities = output.logits.sigmoid()
    expected = -(labels * probabilities.log() + (1 - labels) * (1 - probabilities).log()).mean()
    assert torch.allclose(output.loss, expected, atol=1e-6)


def test_token_loss_ignores_minus_100():
    torch.manual_seed(0)
    model = MODELS["bilstm-tokens"]()
    ids = torch.randint(1, 20, (2, 5))
    labels = torch.tensor([[0, 2, -100, 1, -100], [-100, 1, 1, 0, 2]])
    output = model(ids, labels=labels)
    assert output.logits.shape == (2, 5, 3)
    kept = labels != -100
    expected = -output.logits[kept].log_softmax(-1).gather(1, labels[kept][:, None]).mean()
    assert torch.allclose(output.loss, expected, atol=1e-6)


LEARNING_SETTINGS = {"bilstm": {}, "srnn": {"slice_length": 4}, "bpie-bisrnn": {"slice_length": 4, "enrichment": 2}}


@pytest.mark.parametrize("name", LEARNING_SETTINGS)
def test_learns_whether_a_token_appears(name):
    """Label: does token 5 appear? 40 Adam steps on batches of varied lengths cut the loss well down."""
    torch.manual_seed(0)
    model = baseline_for(name, **{**SIZES, "num_labels": 2, "hidden_size": 16}, **LEARNING_SETTINGS[name])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        ids = torch.randint(6, SIZES["vocab_size"], (16, 12))
        lengths = torch.randint(4, 13, (16,))
        mask = (torch.arange(12) < lengths[:, None]).long()
        labels = torch.randint(0, 2, (16,))
        positive = labels.nonzero().squeeze(1)
        ids[positive, (torch.rand(len(positive)) * lengths[positive]).long()] = 5  # among the real tokens
        loss = model(ids, mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    start, end = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # The labels are fair coins, so a predictor blind to the tokens scores log 2 = 0.69; on the last 80 (unseen) labels
    # it can score at most 0.06 less (the labels' share three standard deviations off 1/2), so 0.1 below needs the tokens.
    assert end < math.log(2) - 0.1, f"loss {start:.3f} -> {end:.3f}"


@pytest.mark.parametrize(
    "model, overrides, argument",
    [
        ("bilstm", {"hidden_size": 0}, "hidden_size"),
        ("bilstm", {"num_layers": 0}, "num_layers"),
        ("bilstm-tokens", {"vocab_size": -3}, "vocab_size"),
        ("bilstm-tokens", {"problem_type": "multi_label_classification"}, "problem_type"),
        ("bilstm", {"problem_type": "regression"}, "problem_type"),
        ("bilstm", {"dropout": 1.0}, "dropout"),
        ("srnn", {"pad_token_id": 20}, "pad_token_id"),
        ("srnn", {"enrichment": 4}, "enrichment"),
        ("srnn", {"enrichment": -1}, "enrichment"),
        ("srnn", {"poolings": ("max", "median")}, "poolings"),
        ("srnn", {"poolings": ()}, "poolings"),
        ("bpie-bisrnn", {"slice_length": 0}, "slice_length"),
        ("bpie-bisrnn", {"num_labels": 0}, "num_labels"),
        ("bpie-bisrnn", {"embedding_size": 0}, "embedding_size"),
    ],
)
def test_bad_arguments(model, overrides, argument):
    with pytest.raises(ValueError, match=argument):
        MODELS[model](**overrides)


def test_unknown_baseline():
    with pytest.raises(ValueError, match="name"):
        baseline_for("gru", **SIZES)


def test_baseline_defaults():
    srnn, bpie = baseline_for("srnn", **SIZES), baseline_for("bpie-bisrnn", **SIZES)
    assert (srnn.bidirectional, srnn.enrichment, srnn.poolings) == (False, 0, ("last",))
    assert (bpie.bidirectional, bpie.enrichment, bpie.poolings) == (True, 5, ("max", "mean", "last"))
    assert baseline_for("bpie-bisrnn", **SIZES, enrichment=2).enrichment == 2
    assert isinstance(baseline_for("bilstm", **SIZES), BiLSTMForSequenceClassification)


def test_count_parameters_excludes_the_embedding():
    model = baseline_for("bilstm", **SIZES, num_layers=1)
    total = sum(p.numel() for p in model.parameters())
    assert count_parameters(model, exclude=()) == total
    assert count_parameters(model) == total - SIZES["vocab_size"] * SIZES["embedding_size"]
    # One BiLSTM layer (2 directions x 4 gates, input and hidden weights, two biases) and the classifier.
    embedding, hidden, labels = SIZES["embedding_size"], SIZES["hidden_size"], SIZES["num_labels"]
    lstm = 2 * 4 * hidden * (embedding + hidden + 2)
    assert count_parameters(model) == lstm + 2 * hidden * labels + labels
