"""What the language-modelling scripts of this folder share (`run_mlm.py`, `run_clm.py`, `evaluate_perplexity.py`):
their text datasets, the cutting of a token stream into blocks, the token that ends a document, and the
special tokens a causal LM is saved with so that it generates as it was trained.

What every example script shares (arguments, data, output folder, checkpoints, trainer, model card) sits one folder
up: `../training_utils.py` and its siblings.
"""

import logging
import math

import numpy as np
from data_loading import check_split_texts, load_splits
from datasets import Dataset, DatasetDict
from tokenizers import processors
from training_utils import ModelArguments
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, PreTrainedTokenizerBase

from ran_hf.files.text_files import split_before_whitespace


logger = logging.getLogger(__name__)


def load_text_datasets(model_args: ModelArguments, data_args) -> DatasetDict:
    """Train / validation text for language modelling, with the text in column "text".

    Without a validation split, `validation_split_percentage` % of the training documents are held out.
    """
    column = data_args.text_column_name
    files = {"train": data_args.train_file, "validation": data_args.validation_file}
    splits = load_splits(
        data_args.dataset_name,
        data_args.dataset_config_name,
        files,
        [column],
        text_columns=(column,),
        cache_dir=model_args.cache_dir,
        token=model_args.token,
        flags={column: "--text_column_name"},
    )
    # Local files: a null or blank text is an error naming its line. Hub corpora (WikiText, say) hold empty rows
    # between paragraphs by design: those are dropped below, and counted.
    if data_args.dataset_name is None:
        check_split_texts(splits, [column], data_args)
    if "validation" not in splits and "train" in splits and data_args.validation_split_percentage > 0:
        check_held_out_split(len(splits["train"]), data_args)
        held_out = splits["train"].train_test_split(test_size=data_args.validation_split_percentage / 100, seed=0)
        splits = DatasetDict(train=held_out["train"], validation=held_out["test"])
    splits = DatasetDict({split: dataset.select_columns([column]) for split, dataset in splits.items()})
    if column != "text":
        splits = splits.rename_column(column, "text")
    kept = splits.filter(lambda example: isinstance(example["text"], str) and bool(example["text"].strip()))
    for split in splits:
        dropped = len(splits[split]) - len(kept[split])
        if dropped:
            logger.info(f"{split}: dropped {dropped:,} empty or blank documents of {len(splits[split]):,}.")
        if len(kept[split]) == 0:
            raise ValueError(f"The {split} split holds no text: its {len(splits[split]):,} documents are all blank.")
    return kept


def check_held_out_split(documents: int, data_args) -> None:
    """Holding out `--validation_split_percentage` % of `documents` training documents (at least one, as `datasets`
    rounds up) must leave one to train on; else an error naming the data and the fix, before any model is loaded
    (`datasets` itself says only that "the resulting train set will be empty")."""
    percentage = data_args.validation_split_percentage
    held_out = math.ceil(percentage / 100 * documents)  # as `Dataset.train_test_split` counts
    if held_out < documents:
        return
    source = data_args.train_file or f"{data_args.dataset_name} (train)"
    raise ValueError(
        f"{source} holds {documents:,} document{'' if documents == 1 else 's'}: with no validation split, "
        f"--validation_split_percentage {percentage} holds out {held_out:,} of {'it' if documents == 1 else 'them'} "
        "for validation and leaves none to train on. Give a validation file (--validation_file), a corpus of more "
        "documents (lines, for a text file), or --validation_split_percentage 0 to train on all of it (without "
        "--do_eval, or with --validation_file)."
    )


# Long texts are tokenized in pieces (`ran_hf.files.text_files.split_before_whitespace`), and at most CALL_CHARACTERS
# characters of them go to the tokenizer in one call: a fast tokenizer holds some 150 bytes per character of what it
# reads at once.
CALL_CHARACTERS = 1 << 18


def token_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str], special_tokens: bool = False) -> list[np.ndarray]:
    """The token ids of each text (int32), its special tokens around it with `special_tokens`, read in pieces
    (`split_before_whitespace`) so that memory follows the piece size, not the longest text."""
    pieces, owners = [], []
    for index, text in enumerate(texts):
        for piece in split_before_whitespace(text):
            pieces.append(piece)
            owners.append(index)
    parts = [[] for _ in texts]
    start = 0
    while start < len(pieces):
        end, size = start + 1, len(pieces[start])
        while end < len(pieces) and size + len(pieces[end]) <= CALL_CHARACTERS:
            size += len(pieces[end])
            end += 1
        encoded = tokenizer(pieces[start:end], add_special_tokens=False, return_attention_mask=False)["input_ids"]
        for owner, ids in zip(owners[start:end], encoded):
            parts[owner].append(np.asarray(ids, dtype=np.int32))
        start = end
    before, after = special_tokens_around(tokenizer) if special_tokens else ([], [])
    return [np.concatenate([np.asarray(before, np.int32), *owned, np.asarray(after, np.int32)]) for owned in parts]


def special_tokens_around(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The special tokens `tokenizer(text)` puts before and after a text's own tokens ([CLS] and [SEP], say)."""
    probe = "end of text"
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    wrapped = tokenizer(probe)["input_ids"]
    for start in range(len(wrapped) - len(bare) + 1):
        if wrapped[start : start + len(bare)] == bare:
            return wrapped[:start], wrapped[start + len(bare) :]
    raise ValueError(
        f"The tokenizer ({type(tokenizer).__name__}) changes a text's tokens when it adds special tokens."
    )


def group_into_blocks(examples: dict[str, list], block_size: int) -> dict[str, list[np.ndarray]]:
    """Concatenate tokenized documents and cut the stream into blocks of `block_size` (the last may be shorter:
    RAN needs no fixed length and the collator pads it). Rows are read and written as int32 arrays (map over a
    dataset `with_format("numpy")`): as Python lists, a long document's tokens would take 36 bytes each."""
    concatenated = {
        key: np.concatenate([np.asarray(row, dtype=np.int32) for row in values]) for key, values in examples.items()
    }
    total = len(next(iter(concatenated.values())))
    return {
        key: [values[start : start + block_size] for start in range(0, total, block_size)]
        for key, values in concatenated.items()
    }


def cut_documents(examples: dict[str, list], block_size: int) -> dict[str, list[np.ndarray]]:
    """Each tokenized document as one example (`--packing`), a document longer than `block_size` cut into pieces of
    `block_size` (the last may be shorter), each its own document: nothing is dropped and no piece reads another."""
    return {
        key: [row[start : start + block_size] for row in values for start in range(0, len(row), block_size)]
        for key, values in examples.items()
    }


class PackedMaskedLMCollator:
    """`--packing` for masked language modelling: a batch's documents in one row without padding, their boundaries
    marked by restarting `position_ids` (`DataCollatorWithFlattening`), then masked as `masking` (a
    `DataCollatorForLanguageModeling`) masks a batch. Flattening first keeps every document's labels: given labels,
    the flattening collator would replace each document's first one by -100, as a causal LM's."""

    def __init__(self, masking: DataCollatorForLanguageModeling):
        self.masking = masking
        self.flattening = DataCollatorWithFlattening()

    def __call__(self, features, return_tensors=None):
        batch = self.flattening([{"input_ids": feature["input_ids"]} for feature in features], return_tensors="pt")
        batch["input_ids"], batch["labels"] = self.masking.torch_mask_tokens(batch["input_ids"])
        return batch


def interleave_streams(token_ids: np.ndarray, num_streams: int, chunk_size: int) -> Dataset:
    """Cut one token stream into `num_streams` parallel streams of whole chunks, ordered so that batches of
    `num_streams` rows, read in order, hold chunk t of every stream in batch t: row r of every batch continues row r
    of the batch before. The tokens that do not fill a chunk of every stream are dropped.

        tokens 0..11, 2 streams, chunks of 3 -> rows [0 1 2] [6 7 8] [3 4 5] [9 10 11]
    """
    chunks_per_stream = len(token_ids) // (num_streams * chunk_size)
    if chunks_per_stream == 0:
        raise ValueError(
            f"{len(token_ids):,} tokens cannot fill one chunk of {chunk_size} tokens in each of {num_streams} "
            "streams: use fewer streams (--per_device_train_batch_size) or a smaller --block_size."
        )
    streams = token_ids[: num_streams * chunks_per_stream * chunk_size].reshape(num_streams, chunks_per_stream, -1)
    return Dataset.from_dict({"input_ids": streams.transpose(1, 0, 2).reshape(-1, chunk_size).tolist()})


def end_of_text_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token that ends a document in a language-modelling stream: EOS, else SEP."""
    token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if token_id is None:
        raise ValueError("The tokenizer has neither an EOS nor a SEP token to end documents with.")
    return token_id


def wraps_prompts(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer("text")` adds special tokens ([CLS]/[SEP], BOS/EOS) around the text's own tokens."""
    probe = "end of text"
    return tokenizer(probe)["input_ids"] != tokenizer(probe, add_special_tokens=False)["input_ids"]


def prepare_for_generation(model, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make a causal LM and its tokenizer (saved beside it) generate the way the model was trained.

    Training reads documents without special tokens, each ended by the end-of-text token (`end_of_text_id`). So the
    tokenizer is changed in place to read a prompt the same way, `tokenizer("text")` giving the text's tokens alone
    (a pair is joined by the end-of-text token, as documents are), and it names that token its EOS; the model's
    config and generation config get it as `eos_token_id`, with the tokenizer's `pad_token_id`, so `generate()` and
    `pipeline("text-generation")` stop at the end of a text.
    """
    end_id = end_of_text_id(tokenizer)
    end_token = tokenizer.convert_ids_to_tokens(end_id)
    if tokenizer.eos_token_id is None:
        tokenizer.eos_token = end_token
    if wraps_prompts(tokenizer):
        for flag in ("add_bos_token", "add_eos_token"):  # tokenizers that rebuild their template from these
            if getattr(tokenizer, flag, False):
                setattr(tokenizer, flag, False)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            backend.post_processor = processors.TemplateProcessing(
                single="$A", pair=f"$A {end_token} $B:1", special_tokens=[(end_token, end_id)]
            )
    if wraps_prompts(tokenizer):
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}) still adds special tokens around a text and has no "
            "`tokenizers` post-processor to change: a causal LM trained on bare text would be prompted with tokens "
            "it never saw mid-text. Use a fast tokenizer (`train_tokenizer.py` writes one)."
        )
    for settings in (model.config, model.generation_config):
        settings.eos_token_id = end_id
        settings.pad_token_id = tokenizer.pad_token_id
