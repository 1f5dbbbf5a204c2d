"""Sequence-to-sequence RAN as a prefix LM (`RANForPrefixLM`, rannet's `RanNetForSeq2Seq`): rannet's outputs on its
own checkpoint, padding invariance, target-side causality (content and length), the cell scans alike, training with
`Trainer`, generation, save/load and remote code without `ran_hf`, bad segments named."""

import json
import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from ran_testing import pad_batch, randomize_, tiny_config
from transformers import AutoModelForSeq2SeqLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from ran_hf import RANForMaskedLM, RANForPrefixLM, RANModel, convert_rannet_checkpoint, prefix_lm_features


FIXTURE = Path(__file__).parent / "fixtures" / "rannet" / "seq2seq_l2_d24_w6"
TOLERANCE = 1e-4  # against rannet (float32 TensorFlow)


def prefix_model(seed=0, **overrides):
    return randomize_(RANForPrefixLM(tiny_config(**overrides)), seed=seed)


def segments(source_length: int, target_length: int) -> torch.Tensor:
    return torch.tensor([0] * source_length + [1] * target_length)


# ---- rannet ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The fixture's official checkpoint through the converter (its variables are the MLM model's)."""
    folder = convert_rannet_checkpoint(FIXTURE, tmp_path_factory.mktemp("seq2seq") / "converted")
    return RANForPrefixLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def expected():
    with np.load(FIXTURE / "expected.npz") as arrays:
        return {key: torch.from_numpy(arrays[key]) for key in arrays.files}


def fixture_cases(expected):
    offsets = expected["offsets"].tolist()
    return [
        (expected["input_ids"][a:b].long(), expected["token_type_ids"][a:b].long(), slice(a, b))
        for a, b in zip(offsets[:-1], offsets[1:])
    ]


def test_converted_checkpoint_matches_rannet_seq2seq(converted, expected):
    """Logits, probabilities (RanNetForSeq2Seq's own output) and last-layer token states of every case, unpadded."""
    for ids, types, tokens in fixture_cases(expected):
        with torch.no_grad():
            output = converted(ids[None], token_type_ids=types[None], output_hidden_states=True)
        logits = output.logits[0]
        assert (logits - expected["mlm_logits"][tokens]).abs().max() <= TOLERANCE
        assert (logits.softmax(-1) - expected["probabilities"][tokens]).abs().max() <= TOLERANCE
        assert (output.hidden_states[-1][0] - expected["token_states"][tokens]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_rannet(converted, expected, side):
    cases = fixture_cases(expected)
    ids, mask = pad_batch([case[0] for case in cases], side=side)
    types, _ = pad_batch([case[1] for case in cases], side=side)
    with torch.no_grad():
        logits = converted(ids, attention_mask=mask, token_type_ids=types).logits
    for row, (_, _, tokens) in enumerate(cases):
        real = mask[row].bool()
        assert (logits[row, real] - expected["mlm_logits"][tokens]).abs().max() <= TOLERANCE


def test_the_converted_masked_lm_with_token_type_ids_is_the_same_network(converted, expected):
    """rannet's seq2seq model is its MLM model with the prefix mask: so is ours (`token_type_ids` on any head)."""
    masked_lm = RANForMaskedLM(converted.config)
    masked_lm.load_state_dict(converted.state_dict())
    ids, types, tokens = fixture_cases(expected)[-1]
    with torch.no_grad():
        logits = masked_lm.eval()(ids[None], token_type_ids=types[None]).logits[0]
    assert (logits - expected["mlm_logits"][tokens]).abs().max() <= TOLERANCE


# ---- the mask -------------------------------------------------------------------------------------------------------


def random_case(seed):
    rng = random.Random(seed)
    window = rng.choice([3, 4, 5])
    overrides = {
        "num_hidden_layers": rng.choice([1, 2, 3]),
        "window_size": window,
        "min_window_size": rng.randint(1, window - 1),
        "window_overlap": rng.choice([0, rng.randint(1, window - 1)]),
        "memory_review": rng.random() < 0.8,
        "cell_pooling": rng.choice(["last", "mean"]),
    }
    return overrides, rng.randint(1, 3 * window), rng.randint(2, 3 * window)


@pytest.mark.parametrize("seed", range(6))
def test_no_target_token_reads_a_later_target_token(seed):
    """Changing target token p changes no logit before p, and dropping the targets after p changes none up to p
    either: a target's output is the same whether the target goes on or not (as when generating)."""
    overrides, source_length, target_length = random_case(seed)
    model = prefix_model(seed, **overrides)
    length = source_length + target_length
    ids = torch.randint(1, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    types = segments(source_length, target_length)[None]
    with torch.no_grad():
        reference = model(ids, token_type_ids=types).logits
        for position in range(source_length, length):
            changed = ids.clone()
            changed[0, position] = 1 + (changed[0, position] % (model.config.vocab_size - 1))
            logits = model(changed, token_type_ids=types).logits
            assert torch.equal(logits[:, :position], reference[:, :position]), f"target {position} leaked backwards"
            assert not torch.equal(logits[:, position:], reference[:, position:])
            cut = model(ids[:, : position + 1], token_type_ids=types[:, : position + 1]).logits
            leaked = f"the target's length leaked at {position}"
            assert torch.allclose(cut, reference[:, : position + 1], atol=1e-5), leaked


def test_every_source_token_reads_the_whole_source():
    model = prefix_model(1, window_size=4, min_window_size=2)
    ids = torch.randint(1, model.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(1))
    types = segments(10, 4)[None]
    with torch.no_grad():
        reference = model(ids, token_type_ids=types).logits
        changed = ids.clone()
        changed[0, 9] = 1 + (changed[0, 9] % (model.config.vocab_size - 1))  # the last source token
        logits = model(changed, token_type_ids=types).logits
    assert not torch.allclose(logits[:, :9], reference[:, :9])  # every earlier source token (and target) sees it


@pytest.mark.parametrize("overrides", [{}, {"window_overlap": 2, "num_hidden_layers": 3}])
def test_padding_never_changes_a_prefix_lm(overrides):
    model = prefix_model(2, **overrides)
    pairs = [(7, 5), (2, 9), (12, 1), (5, 0)]
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(1, model.config.vocab_size, (s + t,), generator=generator) for s, t in pairs]
    types = [segments(s, t) for s, t in pairs]
    with torch.no_grad():
        alone = [model(ids[None], token_type_ids=kind[None]).logits[0] for ids, kind in zip(sequences, types)]
        for side in ("right", "left"):
            ids, mask = pad_batch(sequences, side=side)
            kinds, _ = pad_batch(types, side=side)
            logits = model(ids, attention_mask=mask, token_type_ids=kinds).logits
            for row, expected in enumerate(alone):
                assert torch.allclose(logits[row, mask[row].bool()], expected, atol=1e-5)


def test_reference_and_fused_scans_agree_on_the_prefix_mask():
    """The cell reads the source through the slot mask every scan takes: outputs and gradients agree."""
    results = []
    for scan in ("reference", "fused"):
        model = prefix_model(3, scan_implementation=scan, window_overlap=1).train()
        ids = torch.randint(1, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
        types = torch.stack([segments(9, 7), segments(3, 13)])
        output = model(ids, token_type_ids=types, labels=ids)
        output.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((output.logits.detach(), grads))
    (logits, grads), (fused_logits, fused_grads) = results
    assert torch.allclose(logits, fused_logits, atol=1e-5)
    assert grads.keys() == fused_grads.keys()
    for name in grads:
        assert torch.allclose(grads[name], fused_grads[name], atol=1e-4), name


def test_loss_scores_each_target_token_from_the_tokens_before_it():
    model = prefix_model(4)
    ids = torch.randint(1, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    types = segments(8, 4)[None]
    output = model(ids, token_type_ids=types, labels=ids)  # source labels are ignored: reading them is copying
    log_probs = output.logits[0, 7:11].log_softmax(-1)
    expected = -log_probs.gather(-1, ids[0, 8:12, None]).mean()
    assert torch.allclose(output.loss, expected, atol=1e-6)


# ---- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "types, message",
    [
        ([0, 0, 2, 1], "other than 0 (source) and 1 (target)"),
        ([0, 1, 0, 1], "source token (0) after a target token (1)"),
        ([0.0, 0.0, 1.0, 1.0], "must hold integers"),
        ([[0, 0, 1]], "must have the inputs' shape"),
    ],
)
def test_bad_token_type_ids_are_named(types, message):
    model = prefix_model(5)
    ids = torch.randint(1, model.config.vocab_size, (1, 4))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model(ids, token_type_ids=torch.tensor(types if isinstance(types[0], list) else [types]))


def test_token_type_ids_on_a_causal_model_are_refused():
    model = RANModel(tiny_config(is_causal=True))
    with pytest.raises(ValueError, match="causal model"):
        model(torch.ones(1, 4, dtype=torch.long), token_type_ids=torch.zeros(1, 4, dtype=torch.long))


# ---- training, generation, saving -----------------------------------------------------------------------------------


def test_generate_continues_the_source_as_the_full_forward_predicts():
    model = prefix_model(6, window_size=4, min_window_size=2)
    source = torch.randint(2, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(6))
    target = model.generate(source, max_new_tokens=7, min_new_tokens=7, do_sample=False, pad_token_id=0)
    assert target.shape == (2, 7)  # the target alone, as every model behind AutoModelForSeq2SeqLM returns it
    types = torch.cat([torch.zeros_like(source), torch.ones_like(target)], dim=1)
    with torch.no_grad():
        logits = model(torch.cat([source, target], dim=1), token_type_ids=types).logits
    assert torch.equal(logits[:, 5:-1].argmax(-1), target)


def test_generate_reads_the_initial_cell_it_is_given():
    """`generate(initial_cell=...)` reaches every step's forward (it was dropped on the way to the model)."""
    model = prefix_model(8, window_size=4, min_window_size=2)
    source = torch.randint(2, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(8))
    cell = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(9))
    common = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    common |= {"output_scores": True, "return_dict_in_generate": True}
    scores = model.generate(source, initial_cell=cell, **common).scores
    with torch.no_grad():
        first = model(source, token_type_ids=torch.zeros_like(source), initial_cell=cell).logits[:, -1]
    torch.testing.assert_close(scores[0], first)
    assert not torch.allclose(model.generate(source, **common).scores[0], first)


@pytest.mark.parametrize("kwargs", [{}, {"inputs_embeds": torch.zeros(1, 4, 16)}], ids=["nothing", "embeddings"])
def test_generate_without_a_source_is_refused(kwargs):
    with pytest.raises(ValueError, match="continues a source"):
        prefix_model(0).generate(max_new_tokens=2, **kwargs)


@pytest.mark.needs_data("wikitext-2", "conll2003")  # the WordPiece tokenizer's corpus
def test_trainer_learns_targets_from_sources(wordpiece_tokenizer, tmp_path):
    """(source, target) pairs through `prefix_lm_features`, `DataCollatorForSeq2Seq` and `Trainer`: the loss falls
    below what reading no context can reach."""
    tokenizer = wordpiece_tokenizer
    words = ["court", "state", "law", "market", "trade", "rule", "water", "energy"]
    rng = random.Random(0)
    pairs = []
    for _ in range(32):
        chosen = rng.sample(words, 4)
        pairs.append((" ".join(chosen), " ".join(chosen[:2])))  # the title: the source's first two words
    features = [prefix_lm_features(tokenizer, source, target) for source, target in pairs]
    assert all(len(f["input_ids"]) == len(f["token_type_ids"]) == len(f["labels"]) for f in features)
    config = tiny_config(vocab_size=len(tokenizer), hidden_size=32, head_dim=16, window_size=4, min_window_size=2)
    model = RANForPrefixLM(config)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_train_epochs=40, learning_rate=1e-2,
        logging_steps=4, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=features, data_collator=DataCollatorForSeq2Seq(tokenizer))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    # Below the loss of the best predictor that reads no context at all: each target token's frequency among the
    # targets (their unigram entropy). Lower needs the source or the target's earlier tokens.
    counts = Counter(token for feature in features for token in feature["labels"] if token != -100)
    frequencies = [count / sum(counts.values()) for count in counts.values()]
    unigram_entropy = -sum(p * math.log(p) for p in frequencies)
    last = sum(losses[-5:]) / 5  # the last 20 steps (a batch's loss alone is noisy)
    assert last < unigram_entropy, (losses, unigram_entropy)


GENERATE_WITHOUT_RAN_HF = r"""
import json, sys
import torch
from transformers import AutoModelForSeq2SeqLM

model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
report["class"] = type(model).__name__
report["module"] = type(model).__module__
source = torch.tensor(json.loads(sys.argv[2]))
report["greedy"] = model.generate(source, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()
"""


@pytest.mark.slow
def test_saved_prefix_lm_loads_and_generates_as_remote_code_without_ran_hf(tmp_path):
    from remote_code import run_without_ran_hf

    model = prefix_model(7, window_overlap=1)
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["RANForPrefixLM"]
    assert config["auto_map"]["AutoModelForSeq2SeqLM"].endswith("prefix_lm.RANForPrefixLM")
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "saved")
    assert type(reloaded) is RANForPrefixLM
    source = torch.randint(2, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(7))
    expected = model.generate(source, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(reloaded.generate(source, max_new_tokens=8, do_sample=False, pad_token_id=0), expected)
    report = run_without_ran_hf(GENERATE_WITHOUT_RAN_HF, [tmp_path / "saved", json.dumps(source.tolist())], tmp_path)
    assert report["class"] == "RANForPrefixLM"
    assert report["module"].startswith("transformers_modules"), report["module"]
    assert report["greedy"] == expected.tolist()
