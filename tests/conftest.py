"""Shared fixtures and markers: tiny RAN configurations, the benchmark data folder and a WordPiece tokenizer trained
on it.

Two markers sort the suite (pyproject.toml registers them):
- `needs_data("set", ...)`: the test reads these shared benchmark sets (`../shared/data`, or `$RAN_HF_DATA_DIR`).
  A clone without them skips the test with a reason that names the sets; `test_markers.py` checks that every test
  that reads the data carries the marker.
- `slow`: training loops, subprocess scripts and the Transformers conformance suite. Skipped unless `--run-slow` or
  `RUN_SLOW=1` (CI runs them), so that the default `pytest -n 2` stays within minutes.

`--transformers-tests=<checkout>` points the conformance suite at a Transformers source checkout, whose
`tests/generation/` (not in the sdist) it then runs for the generative classes (docs/architecture.md, "Tests").
"""

import os
import sys
from pathlib import Path

import pytest
import torch


# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (set before any kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import PreTrainedTokenizerFast

from ran_hf import RANConfig
from ran_hf.kernels.choice import triton_ready


if os.environ.get("TRITON_INTERPRET") == "1" and triton_ready():
    from ran_hf.kernels.triton_ops import scan_tiles

    # The interpreter runs a kernel's programs one after another: splitting a head's attention over programs by rows
    # (which compiled kernels run side by side) only multiplies its work. test_triton_scan.py checks the split alone.
    scan_tiles.ROW_SPLITS = 1

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

# The test models are tiny: one intra-op thread is faster than several, and does not oversubscribe shared cores
# (pytest-xdist workers, other jobs on the machine).
torch.set_num_threads(1)

# `RAN_HF_DATA_DIR` points elsewhere; CI sets it to a missing folder to run the suite as a bare clone would.
DATA_DIR = Path(os.environ.get("RAN_HF_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")


def data_available(*sets: str) -> bool:
    """Whether the shared benchmark data (or, when named, each of these sets in it) is present."""
    return DATA_DIR.is_dir() and all((DATA_DIR / name).exists() for name in sets)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow (as RUN_SLOW=1 does)")
    parser.addoption(
        "--transformers-tests",
        metavar="CHECKOUT",
        help="a Transformers source checkout (of the installed version) whose tests/generation/ the conformance "
        "suite runs for the generative classes; without it those tests skip, as the sdist lacks them",
    )


SLOW_TESTS_RUN = os.environ.get("RUN_SLOW", "").lower() in ("1", "true", "yes")
TRANSFORMERS_CHECKOUT = None


def pytest_configure(config):
    global SLOW_TESTS_RUN, TRANSFORMERS_CHECKOUT
    SLOW_TESTS_RUN = SLOW_TESTS_RUN or config.getoption("--run-slow")
    if config.getoption("--transformers-tests"):
        from transformers_sdist import TransformersCheckout

        try:
            TRANSFORMERS_CHECKOUT = TransformersCheckout(config.getoption("--transformers-tests"))
        except ValueError as error:
            raise pytest.UsageError(str(error)) from error


def pytest_report_header(config):
    if TRANSFORMERS_CHECKOUT is not None:
        return TRANSFORMERS_CHECKOUT.describe()


def slow_tests_run() -> bool:
    """Whether this session runs the tests marked slow (for modules that would do slow work at collection)."""
    return SLOW_TESTS_RUN


def transformers_checkout():
    """The `TransformersCheckout` given with `--transformers-tests`, or None."""
    return TRANSFORMERS_CHECKOUT


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not SLOW_TESTS_RUN and item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.skip(reason="slow: run with --run-slow or RUN_SLOW=1 (CI does)"))
        data = item.get_closest_marker("needs_data")
        if data and not data_available(*data.args):
            names = ", ".join(data.args) or "all of them"
            reason = f"needs the shared benchmark sets ({names}), not found in {DATA_DIR}; set RAN_HF_DATA_DIR"
            item.add_marker(pytest.mark.skip(reason=reason))


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
    """The shared benchmark data (see ../shared/data/SOURCES.md); read in place, never copied.

    Only for tests marked `needs_data`, which a clone without the data skips (`test_markers.py` checks the marks).
    """
    return DATA_DIR


@pytest.fixture(scope="session")
def wordpiece_tokenizer_dir(tmp_path_factory) -> Path:
    """A lower-cased BERT-style WordPiece tokenizer (vocab ~2000, [PAD] = 0) trained on CoNLL-2003 and WikiText-2.

    Trained once per session and saved to a temporary folder, whose path is returned. Tests that use it are marked
    `needs_data("wikitext-2", "conll2003")` (`test_markers.py` checks).
    """
    # Trained by the project's own script. Imported here, as the readers are: tests that need no data (the GPU
    # run's kernel tests, say) then need no `datasets` either.
    from train_tokenizer import TokenizerArguments, build_tokenizer

    from ran_hf.files.data import read_conll

    wikitext = [line for line in (DATA_DIR / "wikitext-2" / "valid.txt").open(encoding="utf-8") if line.strip()]
    conll = [" ".join(sentence["tokens"]) for sentence in read_conll(DATA_DIR / "conll2003" / "train.txt")]
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
