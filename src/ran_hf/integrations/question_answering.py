"""Extractive question answering over a whole document, as a Transformers pipeline.

Transformers 5 removed its `question-answering` pipeline (the task name now raises, pointing to chat models), while
`AutoModelForQuestionAnswering` and the span heads remain. `import ran_hf` registers this pipeline under the task
`"extractive-question-answering"`, for `RANForQuestionAnswering` or any other span head:

    from transformers import pipeline
    qa = pipeline("extractive-question-answering", model="path/to/ran-qa")
    qa(question="Who wrote the report?", context=long_document)  # {"score", "start", "end", "answer"}

Unlike the removed pipeline, it does not cut the context into overlapping pieces of `max_seq_len` tokens: RAN reads
the question and the whole document as one pair in a single forward pass, so an answer is chosen with every token of
the document in view. The answer is the span (start <= end, at most `max_answer_len` tokens) of the document with the
highest product of start and end probability, the probabilities taken over the document's tokens only; `start` and
`end` are character offsets into `context`, as before.
"""

import numbers

import torch
import torch.nn.functional as F
from transformers import Pipeline


def question_and_context(pairs: tuple, question, context) -> tuple:
    """The question(s) and context(s) of positional inputs: `(question, context)` strings, one dict with both keys,
    or a list of such dicts."""
    if question is not None or context is not None:
        raise ValueError("Give the question and context by keyword or by position, not both.")
    if len(pairs) == 2 and all(isinstance(text, str) for text in pairs):
        return pairs
    if len(pairs) == 1:
        given = pairs[0]
        dicts = [given] if isinstance(given, dict) else given if isinstance(given, list | tuple) else None
        if dicts is not None and all(
            isinstance(pair, dict) and {"question", "context"} <= pair.keys() for pair in dicts
        ):
            if isinstance(given, dict):
                return given["question"], given["context"]
            return [pair["question"] for pair in dicts], [pair["context"] for pair in dicts]
    raise ValueError(
        f"Give a question and its context as `question=...` and `context=...`, as two strings, as "
        f'{{"question": ..., "context": ...}} or as a list of such dicts; got {pairs!r:.120}.'
    )


class ExtractiveQuestionAnsweringPipeline(Pipeline):
    """Answer spans from a span head (`start_logits`, `end_logits`) over the whole (question, context) pair."""

    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False

    def __call__(self, *pairs, question: str | list[str] | None = None, context: str | list[str] | None = None,
                 **kwargs):  # fmt: skip
        """One answer (or `top_k`) for a question and its context; lists of questions and contexts, pairwise. As
        Transformers' question-answering pipeline took them, also `{"question": ..., "context": ...}` or a list of
        such dicts, or the two strings by position."""
        if pairs:
            question, context = question_and_context(pairs, question, context)
        for name, texts in (("question", question), ("context", context)):
            if not isinstance(texts, str) and not (
                isinstance(texts, list | tuple) and all(isinstance(text, str) for text in texts)
            ):
                raise ValueError(f"`{name}` must be a string or a list of strings, got {texts!r:.80}.")
        if isinstance(question, str) != isinstance(context, str) or (
            not isinstance(question, str) and len(question) != len(context)
        ):
            raise ValueError("Give one `question` and one `context`, or two lists of the same length.")
        batch_size = kwargs.get("batch_size", self._batch_size)
        if batch_size not in (None, 1):
            raise ValueError(
                f"`batch_size={batch_size!r}`: this pipeline reads each (question, context) pair whole, one forward "
                "pass per pair, and does not batch pairs of different lengths together. Leave `batch_size` out (or "
                "1); lists of questions and contexts are answered one pair after another."
            )
        if isinstance(question, str):
            return super().__call__({"question": question, "context": context}, **kwargs)
        if not question:  # Transformers' pipelines fail on an empty list (IndexError)
            return []
        return super().__call__([{"question": q, "context": c} for q, c in zip(question, context)], **kwargs)

    def _sanitize_parameters(self, top_k: int | None = None, max_answer_len: int | None = None):
        postprocess = {}
        for name, value in (("top_k", top_k), ("max_answer_len", max_answer_len)):
            if value is not None:
                postprocess[name] = positive_count(name, value)
        return {}, {}, postprocess

    def preprocess(self, inputs: dict) -> dict:
        if not self.tokenizer.is_fast:
            raise ValueError("Extractive question answering maps tokens to characters: it needs a fast tokenizer.")
        question, context = inputs["question"], inputs["context"]
        if not question.strip() or not context.strip():
            raise ValueError("The question and the context must both hold text.")
        encoding = self.tokenizer(question, context, return_offsets_mapping=True, return_tensors="pt")
        sequence_ids = encoding.sequence_ids(0)
        for index, name, text in ((0, "question", question), (1, "context", context)):
            if index not in sequence_ids:  # zero-width spaces, say: not whitespace to `str.strip`, yet dropped
                shown = repr(text[:80]) + (" ..." if len(text) > 80 else "")
                raise ValueError(
                    f"The {name} {shown} gives no tokens: the tokenizer drops every character of it (zero-width or "
                    f"control characters, say). Give a {name} that holds text."
                )
        in_context = torch.tensor([sequence == 1 for sequence in sequence_ids])
        return {
            "model_inputs": {name: encoding[name] for name in self.tokenizer.model_input_names if name in encoding},
            "offsets": encoding["offset_mapping"][0],
            "in_context": in_context,
            "context": context,
        }

    def _forward(self, inputs: dict) -> dict:
        outputs = self.model(**inputs["model_inputs"])
        return {"start_logits": outputs.start_logits[0], "end_logits": outputs.end_logits[0], **inputs}

    def postprocess(self, outputs: dict, top_k: int = 1, max_answer_len: int = 30):
        in_context = outputs["in_context"]
        for name in ("start_logits", "end_logits"):
            if not outputs[name].float()[in_context].isfinite().all():
                raise ValueError(
                    f"The model's `{name}` over the context hold NaN or infinite values, so no answer can be chosen. "
                    "Check the model's weights (a diverged training run?) and its dtype (float16 overflows; try "
                    "float32 or bfloat16)."
                )
        # Log-probabilities over the document's tokens only: the question, special tokens and padding are no answer.
        # Spans are scored as log(start) + log(end): a product of probabilities underflows to 0 for every span when
        # the logits are large (a confident model), which left no answer to give.
        start, end = (
            outputs[name].float().masked_fill(~in_context, -torch.inf).log_softmax(-1)
            for name in ("start_logits", "end_logits")
        )
        # No span is longer than the document: longer ones would all score -inf, so the work follows the document's
        # length, not `max_answer_len` (2e7 on a 5-token context built a 3.5 GB score matrix).
        max_answer_len = min(max_answer_len, int(in_context.sum()))
        # scores[s, k]: the span from token s to token s + k (k < max_answer_len); spans past the end score -inf.
        ends = F.pad(end, (0, max_answer_len - 1), value=-torch.inf).unfold(0, max_answer_len, 1)
        scores = (start[:, None] + ends).flatten()
        best = scores.topk(min(top_k, int(scores.isfinite().sum()))).indices
        answers = []
        offsets, context = outputs["offsets"], outputs["context"]
        for index in best.tolist():
            first, last = divmod(index, max_answer_len)
            last += first
            start_char, end_char = int(offsets[first][0]), int(offsets[last][1])
            answers.append(
                {
                    "score": scores[index].exp().item(),
                    "start": start_char,
                    "end": end_char,
                    "answer": context[start_char:end_char],
                }
            )
        return answers[0] if top_k == 1 else answers


def positive_count(name: str, value) -> int:
    """A count argument of the pipeline (`top_k`, `max_answer_len`) as an int: an integer, or a float that holds one
    (`2e7`), at least 1; anything else (2.5, "3", True) is an error naming the argument."""
    whole = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"`{name}` must be at least 1, got {value}.")
    return int(value)
