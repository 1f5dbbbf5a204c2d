"""`RANForQuestionAnswering`: Transformers' span loss, padding invariance, saving and loading (as remote code too), and
the `extractive-question-answering` pipeline over a document of several thousand tokens."""

import math
import random

import pytest
import torch
from ran_testing import pad_batch, random_ids, randomize_, tiny_config
from remote_code import run_without_ran_hf
from transformers import AutoModelForQuestionAnswering, pipeline

from ran_hf import RANForQuestionAnswering


MARKER_QUESTION = "where is the marker ?"


def marker_batch(batch_size: int, length: int, marker: int, vocab_size: int, generator: torch.Generator):
    """Random token ids with one `marker` token; the answer is the token after it (start = end)."""
    input_ids = torch.randint(marker + 1, vocab_size, (batch_size, length), generator=generator)
    at = torch.randint(0, length - 1, (batch_size,), generator=generator)
    input_ids[torch.arange(batch_size), at] = marker
    return input_ids, at + 1


def test_the_loss_goes_down_on_a_span_task():
    torch.manual_seed(0)
    model = RANForQuestionAnswering(tiny_config(hidden_size=32, head_dim=16, window_size=8)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(80):  # near chance for the first ~30 steps, then learned
        input_ids, answer = marker_batch(16, 24, marker=3, vocab_size=61, generator=generator)
        loss = model(input_ids, start_positions=answer, end_positions=answer).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # The answer is uniform over positions 1..23, so an input-blind guess scores log(23) = 3.1 on start and end alike.
    assert sum(losses[:5]) / 5 > 2.5
    # Below log(2), the answer's geometric-mean probability exceeds 1/2: more than the 22 other positions together.
    assert sum(losses[-5:]) / 5 < math.log(2)


def test_logits_and_loss_do_not_depend_on_padding():
    model = randomize_(RANForQuestionAnswering(tiny_config()))
    sequences = [random_ids(length, 61, seed) for seed, length in enumerate((13, 7, 10))]
    starts, ends = torch.tensor([2, 6, 0]), torch.tensor([5, 6, 9])
    with torch.no_grad():
        alone = [model(sequence[None]) for sequence in sequences]
        for side in ("right", "left"):
            input_ids, attention_mask = pad_batch(sequences, side=side)
            shift = attention_mask.shape[1] - attention_mask.sum(-1) if side == "left" else torch.zeros(3, dtype=int)
            padded = model(
                input_ids, attention_mask=attention_mask, start_positions=starts + shift, end_positions=ends + shift
            )
            for row, (sequence, single) in enumerate(zip(sequences, alone)):
                real = attention_mask[row].bool()
                torch.testing.assert_close(padded.start_logits[row, real], single.start_logits[0], rtol=0, atol=1e-5)
                torch.testing.assert_close(padded.end_logits[row, real], single.end_logits[0], rtol=0, atol=1e-5)
                assert (padded.start_logits[row, ~real] == torch.finfo(torch.float32).min).all()
            expected = (
                sum(
                    model(sequence[None], start_positions=starts[i : i + 1], end_positions=ends[i : i + 1]).loss
                    for i, sequence in enumerate(sequences)
                )
                / 3
            )
            torch.testing.assert_close(padded.loss, expected, rtol=1e-5, atol=1e-6)


def test_answers_past_the_input_or_on_padding_are_ignored():
    """Transformers' convention (positions clamped, the out-of-range ones ignored), padding counted as outside."""
    model = randomize_(RANForQuestionAnswering(tiny_config()))
    input_ids, attention_mask = pad_batch([random_ids(13, 61, 0), random_ids(7, 61, 1)])
    with torch.no_grad():
        first_only = model(input_ids[:1], start_positions=torch.tensor([3]), end_positions=torch.tensor([4])).loss
        for ignored in (9, 13, 500):  # on padding, one past the end, far past it
            positions = torch.tensor([3, ignored]), torch.tensor([4, ignored])
            loss = model(
                input_ids, attention_mask=attention_mask, start_positions=positions[0], end_positions=positions[1]
            ).loss
            torch.testing.assert_close(loss, first_only, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "positions, message",
    [
        ({"start_positions": torch.tensor([1, 2])}, "both `start_positions` and `end_positions`"),
        ({"start_positions": torch.tensor([1.0, 2.0]), "end_positions": torch.tensor([1, 2])}, "integer token index"),
        (
            {"start_positions": torch.tensor([1, 2, 3]), "end_positions": torch.tensor([1, 2])},
            "one integer token index",
        ),
    ],
)
def test_bad_answer_positions_are_named(positions, message):
    model = RANForQuestionAnswering(tiny_config())
    with pytest.raises(ValueError, match=message):
        model(torch.randint(1, 61, (2, 9)), **positions)


@pytest.mark.slow
def test_save_load_round_trip_and_remote_code(tmp_path):
    model = randomize_(RANForQuestionAnswering(tiny_config()))
    model.save_pretrained(tmp_path / "qa")
    input_ids, attention_mask = pad_batch([random_ids(13, 61, 0), random_ids(7, 61, 1)])
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask)
        reloaded = AutoModelForQuestionAnswering.from_pretrained(tmp_path / "qa").eval()
        assert type(reloaded) is RANForQuestionAnswering
        actual = reloaded(input_ids, attention_mask=attention_mask)
    for name in ("start_logits", "end_logits"):
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-6)

    torch.save(
        {"input_ids": input_ids, "attention_mask": attention_mask, "start_logits": expected.start_logits},
        tmp_path / "expected.pt",
    )
    report = run_without_ran_hf(
        r"""
import torch
from transformers import AutoModelForQuestionAnswering
expected = torch.load(sys.argv[2])
model = AutoModelForQuestionAnswering.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).start_logits
report["class"] = type(model).__module__ + "." + type(model).__name__
report["difference"] = (logits - expected["start_logits"]).abs().max().item()
""",
        [tmp_path / "qa", tmp_path / "expected.pt"],
        tmp_path,
    )
    assert report["class"].startswith("transformers_modules.")
    assert report["class"].endswith(".modeling_ran.RANForQuestionAnswering")
    assert report["difference"] <= 1e-6


def single_token_words(tokenizer, count: int, seed: int) -> list[str]:
    """Lower-case words that the tokenizer keeps whole, in a random order."""
    vocabulary = [word for word in tokenizer.get_vocab() if word.isalpha() and word.islower() and len(word) >= 3]
    random.Random(seed).shuffle(vocabulary)
    return vocabulary[:count]


def marker_document(words: list[str], marker: str, at: int, length: int, rng: random.Random) -> tuple[str, int]:
    """`length` words drawn from `words` with `marker` as word `at`, and the marker's first character."""
    document = [rng.choice(words) for _ in range(length)]
    document[at] = marker
    return " ".join(document), sum(len(word) + 1 for word in document[:at])


@pytest.mark.needs_data("wikitext-2", "conll2003")  # the WordPiece tokenizer's corpus
def test_the_pipeline_answers_from_a_document_of_thousands_of_tokens(make_config, wordpiece_tokenizer, tmp_path):
    """Through a saved folder, in a document of 4,000 words (over 4,000 tokens, one forward pass), the pipeline returns
    exactly the spans the model's own logits score best, at the right characters, best first. The model is a tiny
    one trained briefly to point at a marker word; whether it learns is test_the_loss_goes_down_on_a_span_task's
    business (a tokenizer trained anew per run changes the words; 30 steps find the marker in most documents, not
    all)."""
    tokenizer = wordpiece_tokenizer
    marker, *words = single_token_words(tokenizer, 200, seed=0)
    torch.manual_seed(0)
    config = make_config(
        vocab_size=len(tokenizer), hidden_size=32, head_dim=16, window_size=16, pad_token_id=tokenizer.pad_token_id
    )
    model = RANForQuestionAnswering(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng = random.Random(0)
    for _ in range(30):
        documents = [marker_document(words, marker, rng.randrange(40), 40, rng) for _ in range(16)]
        encoded = tokenizer([MARKER_QUESTION] * 16, [text for text, _ in documents], return_tensors="pt")
        answer = torch.tensor([encoded.char_to_token(i, start, 1) for i, (_, start) in enumerate(documents)])
        loss = model(**encoded, start_positions=answer, end_positions=answer).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval().save_pretrained(tmp_path / "qa")
    tokenizer.save_pretrained(tmp_path / "qa")
    answer_finder = pipeline("extractive-question-answering", model=str(tmp_path / "qa"))

    context, _ = marker_document(words, marker, 3_900, 4_000, random.Random(1))
    encoded = tokenizer(MARKER_QUESTION, context, return_tensors="pt", return_offsets_mapping=True)
    offsets = encoded.pop("offset_mapping")[0]
    assert encoded["input_ids"].shape[1] > 4_000
    with torch.no_grad():
        logits = answer_finder.model(**encoded)
    in_context = torch.tensor([sequence == 1 for sequence in encoded.sequence_ids(0)])
    start_probs, end_probs = (
        scores[0].masked_fill(~in_context, -torch.inf).softmax(-1)
        for scores in (logits.start_logits, logits.end_logits)
    )
    spans = torch.triu(start_probs[:, None] * end_probs[None, :]).tril(4)  # start <= end, at most 5 tokens
    best = int(spans.argmax())
    first, last = divmod(best, spans.shape[1])
    top = answer_finder(question=MARKER_QUESTION, context=context, top_k=3, max_answer_len=5)
    assert len(top) == 3 and top[0]["start"] == int(offsets[first][0]) and top[0]["end"] == int(offsets[last][1])
    assert top[0]["score"] == pytest.approx(spans.max().item(), rel=1e-4)
    assert [answer["score"] for answer in top] == sorted((answer["score"] for answer in top), reverse=True)
    for answer in top:
        assert 0 < answer["score"] <= 1
        assert answer["answer"] == context[answer["start"] : answer["end"]]
        assert len(answer_finder.tokenizer(answer["answer"], add_special_tokens=False)["input_ids"]) <= 5


@pytest.mark.needs_data("wikitext-2", "conll2003")  # the WordPiece tokenizer's corpus
def test_the_pipeline_refuses_bad_calls(make_config, wordpiece_tokenizer):
    model = RANForQuestionAnswering(make_config(vocab_size=len(wordpiece_tokenizer))).eval()
    answer_finder = pipeline("extractive-question-answering", model=model, tokenizer=wordpiece_tokenizer)
    with pytest.raises(ValueError, match="two lists of the same length"):
        answer_finder(question=["a", "b"], context="some text")
    with pytest.raises(ValueError, match="must both hold text"):
        answer_finder(question="a question", context="  ")
    with pytest.raises(ValueError, match="`top_k` must be at least 1"):
        answer_finder(question="a question", context="some text", top_k=0)
    assert len(answer_finder(question=["a", "b"], context=["some text", "more text"])) == 2


@pytest.mark.needs_data("wikitext-2", "conll2003")  # the WordPiece tokenizer's corpus
def test_the_pipeline_takes_transformers_input_forms(make_config, wordpiece_tokenizer):
    """`{"question": ..., "context": ...}`, a list of such dicts and two strings by position, as Transformers' own
    question-answering pipeline took them (a dict raised a TypeError), give the keyword form's answers; anything
    else is named."""
    model = RANForQuestionAnswering(make_config(vocab_size=len(wordpiece_tokenizer))).eval()
    answer_finder = pipeline("extractive-question-answering", model=model, tokenizer=wordpiece_tokenizer)
    question, context = "who wrote it?", "the report was written by the clerk of the court"
    expected = answer_finder(question=question, context=context)
    assert answer_finder({"question": question, "context": context}) == expected
    assert answer_finder(question, context) == expected
    both = answer_finder([{"question": question, "context": context}] * 2)
    assert both == [expected, expected]
    with pytest.raises(ValueError, match='as \\{"question": ..., "context": ...\\}'):
        answer_finder({"question": question})
