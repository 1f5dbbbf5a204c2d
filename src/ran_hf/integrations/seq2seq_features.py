"""A prefix LM's training and generation features from text: `prefix_lm_features` lays one (source, target) pair out
as `RANForPrefixLM` reads it (prefix_lm.py), with `token_type_ids` marking the source (0) and the target (1)."""

from ..prefix_lm import SOURCE, TARGET


# Characters of a source tokenized at first for each token that `max_source_length` keeps: more than a token holds.
CHARACTERS_PER_TOKEN = 64


def truncated_ids(tokenizer, text: str, max_length: int | None) -> list[int]:
    """`tokenizer(text, truncation=True, max_length=max_length)["input_ids"]`, reading only as much of `text` as
    the kept tokens need: a 4 MB source cut to 16 tokens took 8 s and 1.2 GB when tokenized whole.

    The text is read in growing pieces that end just before whitespace, where tokenizers' pre-tokenizers split words,
    so a piece's tokens begin as the whole text's do; once a piece gives more tokens than are kept, they are the
    whole text's first tokens. A piece without whitespace to end at is not cut."""
    if max_length is None:
        return tokenizer(text)["input_ids"]
    characters = CHARACTERS_PER_TOKEN * max_length
    while True:
        cut = max(text.rfind(space, 1, characters + 1) for space in " \t\n\r") if len(text) > characters else -1
        piece = text if cut <= 0 else text[:cut]
        ids = tokenizer(piece, truncation=True, max_length=max_length)["input_ids"]
        if piece is text or len(ids) >= max_length:
            return ids
        characters *= 4


def prefix_lm_features(
    tokenizer, source: str, target: str | None = None, max_source_length=None, max_target_length=None
):
    """`input_ids`, `token_type_ids` and (with a target) `labels` of one (source, target) pair, as `rannet`'s
    `Seq2SeqLMDataLoader` lays them out: the source as the tokenizer encodes it alone (`[CLS] source [SEP]`), then
    the target's tokens and an end of text (`[SEP]`, the tokenizer's `sep_token`), which `generate()` stops at.

    Without a target this is what `generate()` reads. The labels are -100 over the source. `max_source_length` and
    `max_target_length` (None: no limit) count the special tokens: a target keeps `max_target_length - 1` tokens and
    its end of text, a source at least one token besides its special tokens. The source and the target are one
    string each, and each must give tokens (a target of only zero-width characters would teach the model to end
    every text at once).
    """
    for name, text in (("source", source), ("target", target)):
        if not isinstance(text, str) and not (name == "target" and text is None):
            raise ValueError(
                f"The {name} must be one string (one text), got {type(text).__name__} {text!r:.80}: call "
                "`prefix_lm_features` once per (source, target) pair."
            )
    for name, value in (("max_source_length", max_source_length), ("max_target_length", max_target_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"`{name}` must be an int >= 1 (it counts the special tokens: a target's end of text is one), or None "
                f"for no limit; got {value!r}."
            )
    special = tokenizer.num_special_tokens_to_add(pair=False)
    if max_source_length is not None and max_source_length <= special:
        # The tokenizer cannot cut into its special tokens: it would warn and keep the whole source.
        raise ValueError(
            f"`max_source_length={max_source_length}` leaves no room for the source: it counts the tokenizer's "
            f"{special} special token(s), so give at least {special + 1}, or None for no limit."
        )
    source_ids = truncated_ids(tokenizer, source, max_source_length)
    if len(source_ids) <= special:
        raise ValueError(f"The source {source[:80]!r} gives no tokens: give a source that holds text.")
    features = {"input_ids": list(source_ids), "token_type_ids": [SOURCE] * len(source_ids)}
    if target is None:
        return features
    if tokenizer.sep_token_id is None:
        raise ValueError("The tokenizer has no `sep_token`: a prefix LM's target ends with it, as rannet's does.")
    target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
    if not target_ids:
        raise ValueError(
            f"The target {target[:80]!r} gives no tokens (it is empty, or the tokenizer drops every character of it: "
            "zero-width or control characters, say): the model would learn to end the text at once. Give a target "
            "that holds text, or leave the pair out."
        )
    if max_target_length is not None:
        target_ids = target_ids[: max_target_length - 1]
    target_ids = target_ids + [tokenizer.sep_token_id]
    features["input_ids"] += target_ids
    features["token_type_ids"] += [TARGET] * len(target_ids)
    features["labels"] = [-100] * len(source_ids) + target_ids
    return features


__all__ = ["prefix_lm_features"]
