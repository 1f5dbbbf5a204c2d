"""The example training scripts' data: a Hub dataset (`--dataset_name`) or local files (`--train_file`, ...), read
through `datasets` and checked before training, and the data flags every script shares.

A script reads every split whole (`load_splits`: Arrow tables memory-mapped from the `datasets` cache, so that a
whole split costs little memory and a second run little time), takes what it needs from whole splits (the labels:
a run with `--max_train_samples` has the classes of a full run), then keeps the first `--max_*_samples` examples
(`first_examples`: a view, nothing is read or copied) and checks the texts it will use (`check_split_texts`, a
batched map). Errors name the file, line and column of a bad record (`ran_hf.files.data`).

Machinery shared by the example training scripts (`scripts/<task>/run_*.py`), which import it with `scripts/` on
`sys.path`.
"""

from collections.abc import Iterable, Mapping, Sequence

from datasets import DatasetDict, load_dataset
from transformers import PreTrainedTokenizerBase

from ran_hf.files.data import check_columns, check_texts, load_records


def load_splits(
    dataset_name: str | None,
    dataset_config_name: str | None,
    files: Mapping[str, str | None],
    columns: list[str],
    optional_columns: tuple[str, ...] = (),
    text_columns: tuple[str, ...] = (),
    cache_dir: str | None = None,
    token: str | None = None,
    split_columns: Mapping[str, Sequence[str]] | None = None,
    flags: Mapping[str, str] | None = None,
) -> DatasetDict:
    """Every split, whole, from the Hub (`dataset_name`) or from local files (`{"train": path, ...}`), each checked
    to hold `columns`, and those `split_columns` names for it (`{"train": ["label"]}`: the labels a run trains on).

    Local files (jsonl / jsonl.gz / csv / tsv / text) are read by `ran_hf.files.data.load_records`, keeping those
    columns and those of `optional_columns` that their first record holds (a test file without labels, say): every
    record must hold them, each column one kind of value. A missing column is named with the file (or the Hub split),
    the columns it has, and the flag that chose it (`flags`: column -> flag). Texts are checked later, in the examples
    a script keeps (`check_split_texts`); `text_columns` are checked here only in a file that Arrow cannot read.
    """
    split_columns = split_columns or {}

    def needed(split: str) -> list[str]:
        return list(dict.fromkeys([*columns, *split_columns.get(split, ())]))

    if dataset_name is not None:
        splits = load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir, token=token)
        for split, dataset in splits.items():
            check_columns([dict.fromkeys(dataset.column_names)], needed(split), f"{dataset_name} ({split})", flags)
        return splits
    return DatasetDict(
        {
            split: load_records(path, needed(split), optional_columns, text_columns, cache_dir=cache_dir, flags=flags)
            for split, path in files.items()
            if path is not None
        }
    )


def first_examples(splits: DatasetDict, limits: Mapping[str, int | None]) -> DatasetDict:
    """The first `limits[split]` examples of each split (`--max_*_samples`; None keeps them all)."""
    return DatasetDict(
        {
            split: dataset if limits.get(split) is None else dataset.select(range(min(limits[split], len(dataset))))
            for split, dataset in splits.items()
        }
    )


def check_split_texts(splits: DatasetDict, text_columns: Iterable[str], data_args) -> None:
    """Every value of `text_columns` must be a string that is not blank: a bad one is named by its file and line, or
    for a Hub dataset by its split and example (`ran_hf.files.data.check_texts`). `splits` hold the first examples of
    the files of `data_args` (`--train_file`, ...), or of its `--dataset_name`."""
    for split, dataset in splits.items():
        path = None if data_args.dataset_name else getattr(data_args, f"{split}_file", None)
        source = str(path) if path else f"{data_args.dataset_name} ({split})"
        check_texts(dataset, text_columns, source, path)


def check_data_limits(data_args) -> None:
    """The data flags every script's `DataTrainingArguments` may have, checked when parsed: `--max_*_samples` keep
    the first N examples (below 1, nothing would be left to train on or score), `--validation_split_percentage` holds
    out part of the training data (100 would leave none to train on)."""
    for name, value in vars(data_args).items():
        if name.startswith("max_") and name.endswith("_samples") and value is not None and value < 1:
            raise ValueError(f"--{name} must be at least 1 (leave it out to keep every example), got {value}.")
    percentage = getattr(data_args, "validation_split_percentage", None)
    if percentage is not None and not 0 <= percentage < 100:
        raise ValueError(
            f"--validation_split_percentage must be in [0, 100) (0: no split held out), got {percentage}."
        )


def describe_source(data_args) -> str:
    """ "Hub dataset `name` (`config`)" or the data files, for a model card."""
    if data_args.dataset_name:
        config = f" (`{data_args.dataset_config_name}`)" if data_args.dataset_config_name else ""
        return f"Hub dataset `{data_args.dataset_name}`{config}"
    files = [
        f"{split} `{getattr(data_args, f'{split}_file')}`"
        for split in ("train", "validation", "test")
        if getattr(data_args, f"{split}_file", None)
    ]
    return ", ".join(files)


def cut_for_tokenizer(tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int) -> list[str]:
    """The texts, long ones cut to a part that still gives more than `max_length` tokens, to tokenize with truncation.

    A fast tokenizer tokenizes a whole text before truncating it: a 50 MB single-line document cost 8 GB and 100 s to
    keep 256 tokens. Cutting first bounds the cost by `max_length`. Cuts fall on whitespace (where pre-tokenizers
    split) and keep a margin of tokens beyond `max_length`, so the truncated ids are the ones the whole text gives.
    The kept part is the start, or the end for a tokenizer that truncates on the left.
    """
    from_left = tokenizer.truncation_side == "left"
    needed = max_length + 16
    # Text without whitespace (a 50 MB run of one "word") gives few tokens however much of it is read (WordPiece: one
    # [UNK]), and read whole it took 3.3 GB and 150 s: parts grow to at most 256 characters a token kept.
    longest = 256 * needed
    cut_texts = []
    for text in texts:
        characters = 16 * needed
        while len(text) > characters:
            part = cut_at_whitespace(text, characters, from_left)
            if (
                characters >= longest
                or len(tokenizer(part, add_special_tokens=False, return_attention_mask=False)["input_ids"]) >= needed
            ):
                text = part
                break
            characters = min(4 * characters, longest)
        cut_texts.append(text)
    return cut_texts


def cut_at_whitespace(text: str, characters: int, from_left: bool) -> str:
    """The last `characters` characters of `text` (from_left) or the first, shortened to a whitespace boundary."""
    if from_left:
        part = text[-characters:]
        starts = [index for index in (part.find(space) for space in " \t\n\r") if index >= 0]
        return part[min(starts) :] if starts else part
    part = text[:characters]
    end = max(part.rfind(space) for space in " \t\n\r")
    return part[:end] if end > 0 else part
