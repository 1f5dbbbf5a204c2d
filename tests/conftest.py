"""Shared fixtures: tiny RAN configurations, the benchmark data folder and a WordPiece tokenizer trained on it."""

import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (set before any kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import PreTrainedTokenizerFast

from ran_hf import RANConfig, triton_scan_kernels
from ran_hf.data import read_conll

if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter runs a kernel's programs one after another: splitting a head's attention over programs by rows
    # (which compiled kernels run side by side) only multiplies its work. test_triton_scan.py checks the split alone.
    triton_scan_kernels.ROW_SPLITS = 1

# The scripts the tests import, each from its folder (scripts/README.md): the shared ones in scripts/, the example
# training scripts in their task folders, the benchmarks with their baselines.
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCRIPT_FOLDERS = (
    ".",
    "language-modeling",
    "text-classification",
    "token-classification",
    "sentence-embeddings",
    "summarization",
    "benchmarks",
)
sys.path[:0] = [str(SCRIPTS / folder) for folder in SCRIPT_FOLDERS]

# The tokenizer the tests use is trained by the project's own script.
from train_tokenizer import TokenizerArguments, build_tokenizer  # noqa: E402

# The test models are tiny: one intra-op thread is faster than several, and does not oversubscribe shared cores
# (pytest-xdist workers, other jobs on the machine).
torch.set_num_threads(1)

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"

# Small enough to run in milliseconds, large enough that a 13-token input spans several windows (with a merged tail).
TINY_CONFIG = {
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "head_dim": 8,
    "window_size": 4,
    "min_window_size": 2,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


@pytest.fixture
def make_config():
    """Factory for a tiny `RANConfig`; keyword arguments override `TINY_CONFIG`."""

    def make(**overrides) -> RANConfig:
        return RANConfig(**{**TINY_CONFIG, **overrides})

    return make


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared benchmark data (see ../shared/data/SOURCES.md); read in place, never copied."""
    if not DATA_DIR.is_dir():
        pytest.skip(f"benchmark data not found at {DATA_DIR}")
    return DATA_DIR


@pytest.fixture(scope="session")
def wordpiece_tokenizer_dir(data_dir, tmp_path_factory) -> Path:
    """A lower-cased BERT-style WordPiece tokenizer (vocab ~2000, [PAD] = 0) trained on CoNLL-2003 and WikiText-2.

    Trained once per session and saved to a temporary folder, whose path is returned.
    """
    wikitext = [line for line in (data_dir / "wikitext-2" / "valid.txt").open(encoding="utf-8") if line.strip()]
    conll = [" ".join(sentence["tokens"]) for sentence in read_conll(data_dir / "conll2003" / "train.txt")]
    folder = tmp_path_factory.mktemp("wordpiece_tokenizer")
    arguments = TokenizerArguments(train_files=[], output_dir=str(folder), vocab_size=2000, model_max_length=512)
    build_tokenizer(arguments, wikitext[:3000] + conll[:3000]).save_pretrained(folder)
    return folder


@pytest.fixture
def wordpiece_tokenizer(wordpiece_tokenizer_dir) -> PreTrainedTokenizerFast:
    """A fresh copy of the trained tokenizer, loaded from its folder as a user would load it.

    Pipelines may change a tokenizer's settings (text generation sets `padding_side="left"`), so tests never share one.
    """
    return PreTrainedTokenizerFast.from_pretrained(wordpiece_tokenizer_dir)
