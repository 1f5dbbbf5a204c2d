"""Convert an official RAN checkpoint (the TensorFlow `rannet` release) into a Transformers folder.

The official release (e.g. "V3 EN base", used with `rannet>0.2.1`) is a folder holding `config.json` (the keys of
`rannet.RanNetParams`), `vocab.txt` (a lower-cased WordPiece vocabulary) and a TensorFlow checkpoint
(`model.ckpt.index`, `model.ckpt.data-*`). Its variables are named as in `RanNet.variable_mapping`
(`rannet/ran-0/encode-attn/dense-q/kernel`, ...). Checkpoints saved by `rannet`'s own pretraining (Keras
`save_weights`, names like `layer_with_weights-2/encode_attn/q_dense/kernel/.ATTRIBUTES/VARIABLE_VALUE`) are read
too, as `RanNet.export_checkpoint` would rename them.

`convert_rannet_checkpoint` writes a folder that loads with the Auto classes and `trust_remote_code=True`:

* `config.json`, `model.safetensors` and the model code: a `RANForMaskedLM` (encoder and MLM head) saved with
  `save_pretrained`. Other heads (`AutoModelForSequenceClassification`, `AutoModelForTokenClassification`) load the
  encoder from it and start their own layers fresh, as they do in `rannet`. A `RanNetForAdaptiveLM` checkpoint
  (Keras `save_weights`, recognised by its output mapping) becomes a causal `RANForCausalLM` with `cutoffs` and
  `div_val` read from its embeddings' shapes (docs/adaptive-softmax.md).
* `tokenizer.json` and `tokenizer_config.json`: the fast-tokenizer equivalent of `rannet.RanNetWordPieceTokenizer`
  (BERT normalisation with lower-casing and accent stripping, BERT pre-tokenisation, WordPiece with `##`
  continuations), which gives `rannet`'s ids. Like `rannet`, and like the data the released model was pretrained on,
  it adds **no special tokens** to a single sequence (no `[CLS]`/`[SEP]`; RAN classifies from its cells, not from a
  special token); a pair becomes `A [SEP] B [SEP]`.
* `README.md`: the model card.

The TensorFlow checkpoint is read by `ran_hf.files.tf_checkpoint`, with NumPy alone: converting needs no TensorFlow.

Usage:

```python
>>> from ran_hf import convert_rannet_checkpoint

>>> convert_rannet_checkpoint("rannet-v3-en-base", "ran-v3-en-base")  # doctest: +SKIP
```

or `python scripts/convert_rannet_checkpoint.py --rannet_dir rannet-v3-en-base --output_dir ran-v3-en-base`.
"""

import hashlib
import json
import os
import re
from importlib import resources
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.utils import logging

from ..configuration_ran import RANConfig
from ..files.folder_locks import lock_folder, releases_folder_locks
from ..files.folders import write_folder
from ..files.paths import check_not_inputs, contents, keeps_user_files
from ..files.recovery import recover_interrupted
from ..modeling_ran import RANForCausalLM, RANForMaskedLM
from .rannet_checkpoint import PREFIX, convert_variables, read_checkpoint


logger = logging.get_logger(__name__)

__all__ = [
    "RANNET_CONFIG_KEYS",
    "OutputFolderNotEmptyError",
    "build_rannet_tokenizer",
    "convert_rannet_checkpoint",
    "rannet_config_to_ran_config",
]

# --------------------------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------------------------

# Official key -> (`RANConfig` fields it sets, the default `rannet.RanNetParams` uses when the key is absent).
RANNET_CONFIG_KEYS = {
    "vocab_size": (("vocab_size",), None),  # required
    "embedding_size": (("hidden_size",), 512),
    "dropout_rate": (("hidden_dropout_prob", "attention_probs_dropout_prob"), 0.1),
    "ran_layers": (("num_hidden_layers",), 2),
    "head_size": (("head_dim",), 128),
    "head_num": (("num_attention_heads",), 8),
    "window_size": (("window_size",), 256),
    "min_window_size": (("min_window_size",), 16),
    "cell_pooling": (("cell_pooling",), "last"),
    "kernel_initializer_range": (("initializer_range",), 0.02),
}
# Keys that only choose how `rannet` initialises a fresh model: accepted, and without meaning for trained weights.
RANNET_INITIALIZER_KEYS = ("embedding_initializer", "kernel_initializer")


def rannet_config_to_ran_config(rannet_config: dict, source: str = "config.json") -> dict:
    """Map an official `config.json` dict onto `RANConfig` keyword arguments.

    Absent keys take `rannet`'s defaults; initializer kinds are dropped; any other key is an error, since silently
    ignoring it could give a model that computes something else than the checkpoint was trained for.
    """
    unknown = sorted(set(rannet_config) - set(RANNET_CONFIG_KEYS) - set(RANNET_INITIALIZER_KEYS))
    if unknown:
        raise ValueError(
            f"{source}: unknown key(s) {', '.join(repr(key) for key in unknown)}; an official RAN config has only "
            f"{', '.join(sorted(RANNET_CONFIG_KEYS) + sorted(RANNET_INITIALIZER_KEYS))}"
        )
    if "vocab_size" not in rannet_config:
        raise ValueError(f"{source}: the required key 'vocab_size' is missing")
    kwargs = {}
    for key, (fields, default) in RANNET_CONFIG_KEYS.items():
        for field in fields:
            kwargs[field] = rannet_config.get(key, default)
    return kwargs


def read_rannet_config(path: Path) -> RANConfig:
    try:
        rannet_config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(rannet_config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(rannet_config).__name__}")
    kwargs = rannet_config_to_ran_config(rannet_config, str(path))
    try:
        return RANConfig(**kwargs, pad_token_id=0)  # pad id 0: `rannet` treats every id > 0 as a token
    except (TypeError, ValueError, StrictDataclassError) as error:
        # Name the official keys, not the `RANConfig` fields they became (`@strict`'s error: its cause).
        message = str(error.__cause__ if isinstance(error, StrictDataclassError) else error)
        for key, (fields, _) in RANNET_CONFIG_KEYS.items():
            for field in fields:
                message = message.replace(f"`{field}`", f"`{key}`")
        raise ValueError(f"{path}: {message}") from None


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------------------

# `rannet.tokenizer.SpecialTokens`: each is a special (unsplittable, skipped when decoding) token if the vocabulary
# has it. The first four must be there: [PAD] as id 0 (the padding mask is `ids > 0`), [SEP] for pairs, [UNK] for
# unknown words and [MASK] for the masked-LM head.
RANNET_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[MASK]", "[SEP]", "[START]", "[END]") + tuple(
    f"[unused{i}]" for i in range(1000)
)
REQUIRED_TOKENS = ("[PAD]", "[UNK]", "[SEP]", "[MASK]")


def read_vocab(path: Path) -> tuple[dict[str, int], int]:
    """The WordPiece vocabulary as `tokenizers` reads it (token -> line number), and the number of lines."""
    vocab = models.WordPiece.read_file(str(path))
    num_lines = max(vocab.values()) + 1 if vocab else 0
    for token in REQUIRED_TOKENS:
        if token not in vocab:
            raise ValueError(f"{path}: the vocabulary has no {token} token")
    if vocab["[PAD]"] != 0:
        raise ValueError(f"{path}: [PAD] must be the first token (id 0), found at id {vocab['[PAD]']}")
    return vocab, num_lines


def build_rannet_tokenizer(vocab_file: str | os.PathLike) -> PreTrainedTokenizerFast:
    """The fast tokenizer that gives the ids of `rannet.RanNetWordPieceTokenizer(vocab_file, lowercase=True)`.

    Single sequences get no special tokens (as in `rannet` and in the released model's pretraining data); pairs become
    `A [SEP] B [SEP]` with token type 1 for `B [SEP]`. `token_type_ids` are not returned: RAN has no segment
    embedding. There is no length limit: RAN reads documents of any length.
    """
    vocab, _ = read_vocab(Path(vocab_file))
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix="##"))
    backend.add_special_tokens([token for token in RANNET_SPECIAL_TOKENS if token in vocab])
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )  # strip_accents=None: strip them because text is lower-cased
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A [SEP] $B:1 [SEP]:1", special_tokens=[("[SEP]", vocab["[SEP]"])]
    )
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "attention_mask"],
    )


# --------------------------------------------------------------------------------------------------------------------
# The folder
# --------------------------------------------------------------------------------------------------------------------

MODEL_CARD = "rannet-v3-en-base.md"
ADAPTIVE_MODEL_CARD = "rannet-adaptive-lm.md"  # a converted RanNetForAdaptiveLM


def find_checkpoint_prefix(folder: Path) -> str:
    """The checkpoint prefix in `folder`: the one its `checkpoint` state file names, else its only `*.index`."""
    state_file = folder / "checkpoint"
    if state_file.is_file():
        match = re.search(
            r'^model_checkpoint_path:\s*"(.*)"\s*$', state_file.read_text(encoding="utf-8"), re.MULTILINE
        )
        if match is None:
            raise ValueError(f"{state_file}: no model_checkpoint_path line")
        prefix = Path(match.group(1))
        prefix = prefix if prefix.is_absolute() else folder / prefix
        if not Path(f"{prefix}.index").is_file() and Path(f"{folder / prefix.name}.index").is_file():
            prefix = folder / prefix.name  # a folder moved after saving with absolute paths
        return str(prefix)
    indexes = sorted(folder.glob("*.index"))
    if len(indexes) != 1:
        found = ", ".join(path.name for path in indexes) or "none"
        raise FileNotFoundError(
            f"{folder}: expected one TensorFlow checkpoint (a `*.index` file with its `*.data-*` files, such as "
            f"model.ckpt.index) or a `checkpoint` file naming one; found {found}"
        )
    return str(indexes[0].with_suffix(""))


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_card(config: RANConfig, rannet_dir: Path, source_files: list[Path]) -> str:
    """The packaged model card, followed by what this conversion read and wrote."""
    name = ADAPTIVE_MODEL_CARD if config.cutoffs is not None else MODEL_CARD
    card = resources.files("ran_hf").joinpath("model_cards").joinpath(name).read_text(encoding="utf-8")
    rows = [
        ("layers", config.num_hidden_layers),
        ("hidden size", config.hidden_size),
        ("heads x head size", f"{config.num_attention_heads} x {config.head_dim}"),
        ("window / minimum window", f"{config.window_size} / {config.min_window_size}"),
        ("cell pooling", config.cell_pooling),
        ("memory review", config.memory_review),
        ("vocabulary", config.vocab_size),
    ]
    if config.cutoffs is not None:
        rows += [("adaptive softmax: cutoffs / div_val", f"{config.cutoffs} / {config.div_val}")]
    lines = [
        "",
        "## This conversion",
        "",
        f"Converted by `ran_hf.convert_rannet_checkpoint` from `{rannet_dir.name}/`.",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in rows),
        "",
        "Source files (SHA-256):",
        "",
        *(f"- `{path.name}`: `{file_digest(path)}`" for path in source_files),
        "",
    ]
    return card.rstrip("\n") + "\n" + "\n".join(lines)


class OutputFolderNotEmptyError(FileExistsError):
    """The output folder exists and is not empty, and replacing it was not asked for. The message names the Python
    argument (`overwrite=True`); a command line that sets it another way says so with `fix("add --overwrite")`."""

    def __init__(self, output_dir: str | os.PathLike):
        self.output_dir = Path(output_dir)
        super().__init__(self.fix("pass overwrite=True"))

    def fix(self, how: str) -> str:
        return (
            f"{self.output_dir} exists and is not empty; {how} to replace the model there (files that are not a "
            "saved model's stay), or choose another output folder."
        )


@releases_folder_locks
def convert_rannet_checkpoint(
    rannet_dir: str | os.PathLike, output_dir: str | os.PathLike, overwrite: bool = False
) -> Path:
    """Convert the official RAN checkpoint in `rannet_dir` into a Transformers folder at `output_dir`.

    Everything is read and checked before anything is written; the folder is written next to `output_dir` under a
    temporary name and moved into place at the end, so a failed conversion leaves no partial folder (and what a killed
    one left beside `output_dir` is cleaned up by the next run). An existing, non-empty `output_dir` is replaced only
    with `overwrite=True`, and then only a saved model's files go (`ran_hf.files.paths.keeps_user_files`): your notes
    and other files there stay. An `output_dir` that is `rannet_dir`, contains it or lies inside it is always refused.

    Args:
        rannet_dir: folder with `config.json`, `vocab.txt` and a TensorFlow checkpoint (`model.ckpt.index` and
            `model.ckpt.data-*`, or the checkpoint a `checkpoint` state file names).
        output_dir: the folder to write.
        overwrite: replace the model in `output_dir` if it exists and is not empty (files that are not a saved
            model's stay).

    Returns:
        The path of the written folder.

    Raises:
        FileNotFoundError: a folder or file is missing.
        OutputFolderNotEmptyError: `output_dir` exists, is not empty, and `overwrite` is False (a `FileExistsError`).
        ValueError: `output_dir` is, contains or lies inside `rannet_dir`; or the config, vocabulary or checkpoint is
            not an official RAN checkpoint or disagrees with itself (the message names the file and the key or
            variable).
    """
    rannet_dir, output_dir = Path(rannet_dir), Path(output_dir)
    if not rannet_dir.is_dir():
        raise FileNotFoundError(f"RAN checkpoint folder not found: {rannet_dir}")
    config_path, vocab_path = rannet_dir / "config.json", rannet_dir / "vocab.txt"
    for path in (config_path, vocab_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path.name} not found in {rannet_dir}")
    check_apart(rannet_dir, output_dir)
    prefix = find_checkpoint_prefix(rannet_dir)  # its `checkpoint` file may name a checkpoint elsewhere
    checkpoint_files = sorted(Path(prefix).parent.glob(Path(prefix).name + ".*"))
    check_not_inputs(output_dir, "output_dir", [("the TensorFlow checkpoint file", path) for path in checkpoint_files])
    lock_folder(output_dir)  # released when this function returns
    for note in recover_interrupted(output_dir):
        logger.warning(f"Before converting: {note}.")
    if output_dir.exists() and not (output_dir.is_dir() and not contents(output_dir)) and not overwrite:
        raise OutputFolderNotEmptyError(output_dir)

    # 1. Read and check everything.
    config = read_rannet_config(config_path)
    variables, memory_review, config = read_checkpoint(prefix, config)
    _, vocab_lines = read_vocab(vocab_path)
    embedding = "the adaptive embedding" if config.cutoffs is not None else f"{PREFIX}/token-embedding/embeddings"
    if vocab_lines != config.vocab_size:  # the embeddings' rows were checked against it
        raise ValueError(
            f"{vocab_path}: the vocabulary has {vocab_lines} tokens, but {embedding} in {prefix}.index has "
            f"{config.vocab_size} rows"
        )
    config.memory_review = memory_review
    model = (RANForCausalLM if config.cutoffs is not None else RANForMaskedLM)(config)
    model.load_state_dict(convert_variables(variables, model), strict=True)
    model.eval()
    tokenizer = build_rannet_tokenizer(vocab_path)
    source_files = [config_path, vocab_path] + checkpoint_files

    # 2. Write into a temporary folder, then put it in place (an existing folder, empty or replaced on request, is
    # set aside until the new one is in place, and its entries that are not a model's files moved over; a mount point
    # keeps its place and gets new contents).
    with write_folder(output_dir, "converting", carry_over=keeps_user_files) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "README.md").write_text(model_card(config, rannet_dir, source_files), encoding="utf-8")
    return output_dir


def check_apart(rannet_dir: Path, output_dir: Path) -> None:
    """Refuse an output folder that is the source, contains it or lies inside it: replacing it would delete the
    official checkpoint, and writing into it would mix the two."""
    source, output = rannet_dir.resolve(), output_dir.resolve()
    if output == source:
        relation = "is the RAN checkpoint folder"
    elif output in source.parents:
        relation = f"contains the RAN checkpoint folder {rannet_dir}"
    elif source in output.parents:
        relation = f"lies inside the RAN checkpoint folder {rannet_dir}"
    else:
        return
    raise ValueError(
        f"The output folder {output_dir} {relation}: converting there would replace or mix with the checkpoint being "
        "read. Choose an output folder outside it."
    )
