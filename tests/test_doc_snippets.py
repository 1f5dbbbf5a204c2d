"""Every code block of README.md and docs/*.md runs as written.

What runs. Each fenced ```python block is one test case, named by its document and the line of its opening fence
(`docs/generation.md:16`). It runs as written, in a fresh namespace of its own (no block of these documents builds on
an earlier one, so none shares names), with a temporary folder as its working directory, in place of the repository
root, so that a block that writes `outputs/...` leaves the checkout alone. Line numbers in its traceback are the
document's. A block that imports `ran_hf` runs in this process; one that does not runs in a fresh interpreter, since
it must work where `ran_hf` was never imported (a saved folder's remote code, sentence-transformers): in this process
`conftest.py` has already imported it, which would hide a missing `import ran_hf`. ```json and ```yaml blocks (config
files) must parse.

What does not run. ```bash blocks are not executed: they install things, start training runs and benchmarks of
minutes to hours, or launch several processes; the scripts they call have their own tests (`test_scripts.py` and the
tests named after each script). ```bibtex and unlabelled blocks (a citation, a file layout, output) are not code.

Markers. A block that cannot run on its own is marked in the document by HTML comments on the lines right above its
fence (no blank line between; several may stack), which a reader of the Markdown source sees and which the test
reads:

    <!-- snippet: needs PATH: what it is -->   the block reads PATH (relative to the repository root), a file or folder
                                               it does not make: a trained model, a converted checkpoint.
    <!-- snippet: skip: why -->                the block cannot run as a test at all (a script for torchrun).
    <!-- snippet: slow -->                     the block takes long (training): marked `slow`, run with --run-slow.

For some PATHs this test makes a tiny stand-in in the temporary folder (`STAND_INS`: an untrained model of the right
kind saved with a tokenizer, a converted fixture checkpoint, a LoRA adapter), so the block runs as written against
it; a block that needs anything else is skipped with the marker's text as the reason. `../shared/data` (or a set in
it) is the shared benchmark data: the block is marked `needs_data`, and runs only where the data exists (it is linked
beside the temporary folder, so `../shared/data/...` reads it). Snippet text is never changed at test time: a block
too slow to run here is made smaller in the document itself.

A block without a marker must run. A marker that is malformed, or not directly above a python block, fails
`test_markers_sit_above_python_blocks`; `test_the_extractor_finds_every_known_block` guards against an extractor that
finds nothing.
"""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import DATA_DIR, data_available


ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Python blocks each document held when this test was written: the extractor must find at least these.
KNOWN_PYTHON_BLOCKS = {
    "README.md": 3,
    "docs/adaptive-softmax.md": 2,
    "docs/architecture.md": 1,
    "docs/checkpoints.md": 1,
    "docs/generation.md": 1,
    "docs/seq2seq.md": 1,
    "docs/training.md": 5,
}

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<body>.*?)\s*-->\s*$")
NEEDS = re.compile(r"^needs (?P<path>\S+): (?P<what>\S.*)$")
SKIP = re.compile(r"^skip: (?P<why>\S.*)$")
SHARED_DATA = "../shared/data"


@dataclass(frozen=True)
class Block:
    document: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    needs: tuple = ()  # (path, what it is) pairs
    skip: str | None = None
    slow: bool = False

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"


@dataclass
class Extraction:
    blocks: list = field(default_factory=list)
    problems: list = field(default_factory=list)


def extract(text: str, document: str) -> Extraction:
    """The fenced code blocks of one Markdown text, with the markers above them, and any malformed markers."""
    found = Extraction()
    lines = text.splitlines()
    markers = []  # (line number, body) of the markers since the last other line
    index = 0
    while index < len(lines):
        line = lines[index]
        marker = MARKER.match(line)
        fence = FENCE.match(line)
        if marker:
            markers.append((index + 1, marker.group("body")))
        elif "<!-- snippet" in line or "<!--snippet" in line:
            found.problems.append(f"{document}:{index + 1}: malformed snippet marker: {line.strip()}")
        elif fence:
            opening, indent = fence.group("fence"), len(fence.group("indent"))
            language = (fence.group("info").split() or [""])[0].lower()
            closing = re.compile(rf"^[ \t]*{re.escape(opening[0])}{{{len(opening)},}}\s*$")
            end = index + 1
            while end < len(lines) and not closing.match(lines[end]):
                end += 1
            if end == len(lines):
                found.problems.append(f"{document}:{index + 1}: code block never closed")
            code = "".join(f"{row[indent:] if not row[:indent].strip() else row}\n" for row in lines[index + 1 : end])
            needs, skip, slow = [], None, False
            for number, body in markers:
                if language not in ("python", "py"):
                    found.problems.append(f"{document}:{number}: a snippet marker above a {language or 'plain'} block")
                elif body == "slow":
                    slow = True
                elif match := NEEDS.match(body):
                    needs.append((match.group("path"), match.group("what")))
                elif match := SKIP.match(body):
                    skip = match.group("why")
                else:
                    found.problems.append(f"{document}:{number}: unknown snippet marker: {body!r}")
            found.blocks.append(Block(document, index + 1, language, code, tuple(needs), skip, slow))
            markers = []
            index = end
        elif markers:
            for number, body in markers:
                found.problems.append(f"{document}:{number}: snippet marker not directly above a code block: {body!r}")
            markers = []
        index += 1
    for number, body in markers:
        found.problems.append(f"{document}:{number}: snippet marker not directly above a code block: {body!r}")
    return found


def extract_documents() -> Extraction:
    found = Extraction()
    for path in DOCUMENTS:
        one = extract(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
        found.blocks += one.blocks
        found.problems += one.problems
    return found


EXTRACTED = extract_documents()
PYTHON_BLOCKS = [block for block in EXTRACTED.blocks if block.language in ("python", "py")]
CONFIG_BLOCKS = [block for block in EXTRACTED.blocks if block.language in ("json", "yaml", "yml")]


def shared_data_sets(path: str) -> list | None:
    """The shared benchmark sets a needed path names (an empty list: the whole folder), or None if it is not data."""
    if path == SHARED_DATA:
        return []
    if path.startswith(SHARED_DATA + "/"):
        return [path[len(SHARED_DATA) + 1 :].split("/")[0]]
    return None


def data_sets(block: Block) -> list | None:
    """The shared benchmark sets a block reads (an empty list: the whole folder), or None if it reads none."""
    named = [sets for path, _ in block.needs if (sets := shared_data_sets(path)) is not None]
    return None if not named else sorted({name for sets in named for name in sets})


def python_case(block: Block):
    marks = []
    if block.slow:
        marks.append(pytest.mark.slow)
    sets = data_sets(block)
    if sets is not None:
        marks.append(pytest.mark.needs_data(*sets))
    return pytest.param(block, id=block.id, marks=marks)


# --- tiny stand-ins for the folders the documents' blocks read -------------------------------------------------------

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16, "window_size": 32}


@pytest.fixture(scope="session")
def stand_in_tokenizer_dir(tmp_path_factory) -> Path:
    """A WordPiece tokenizer of `scripts/train_tokenizer.py` (vocabulary 2,000) trained on this project's documents."""
    from train_tokenizer import TokenizerArguments, build_tokenizer

    folder = tmp_path_factory.mktemp("doc_snippet_tokenizer")
    texts = [line for path in DOCUMENTS for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    arguments = TokenizerArguments(train_files=[], output_dir=str(folder), vocab_size=2000)
    build_tokenizer(arguments, texts).save_pretrained(folder)
    return folder


def save_with_tokenizer(model, folder: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)


def tiny_config(tokenizer_dir: Path, **overrides):
    from transformers import AutoTokenizer

    from ran_hf import RANConfig

    return RANConfig(vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)), **{**TINY, **overrides})


def make_tokenizer(folder: Path, tokenizer_dir: Path) -> None:
    shutil.copytree(tokenizer_dir, folder)


def make_classifier(folder: Path, tokenizer_dir: Path) -> None:
    from ran_hf import RANForSequenceClassification

    save_with_tokenizer(RANForSequenceClassification(tiny_config(tokenizer_dir, num_labels=2)), folder, tokenizer_dir)


def make_masked_lm(folder: Path, tokenizer_dir: Path) -> None:
    from ran_hf import RANForMaskedLM

    save_with_tokenizer(RANForMaskedLM(tiny_config(tokenizer_dir)), folder, tokenizer_dir)


def make_causal_lm(folder: Path, tokenizer_dir: Path) -> None:
    """As `run_clm.py` saves one: the tokenizer reads a prompt without [CLS]/[SEP], and [SEP] ends a text."""
    from lm_data import prepare_for_generation
    from transformers import AutoTokenizer

    from ran_hf import RANForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = RANForCausalLM(tiny_config(tokenizer_dir, is_causal=True))
    prepare_for_generation(model, tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def make_prefix_lm(folder: Path, tokenizer_dir: Path) -> None:
    from ran_hf import RANForPrefixLM

    save_with_tokenizer(RANForPrefixLM(tiny_config(tokenizer_dir)), folder, tokenizer_dir)


def make_sentence_transformers_classifier(folder: Path, tokenizer_dir: Path) -> None:
    from ran_hf.integrations.sentence_embeddings import write_sentence_transformers_config

    make_classifier(folder, tokenizer_dir)
    write_sentence_transformers_config(folder, pooling="cell_transform")


def make_lora_adapter(folder: Path, tokenizer_dir: Path) -> None:
    """A LoRA adapter of a hyperpartisan classifier (labels false, true) on `outputs/pipeline/mlm` beside it."""
    pytest.importorskip("peft")
    from peft import get_peft_model

    from ran_hf import RANForSequenceClassification, ran_lora_config

    base_folder = folder.parent / "pipeline" / "mlm"
    if not base_folder.exists():
        make_masked_lm(base_folder, tokenizer_dir)
    base = RANForSequenceClassification.from_pretrained(base_folder, num_labels=2, id2label={0: "false", 1: "true"})
    get_peft_model(base, ran_lora_config(base, r=4, lora_alpha=8)).save_pretrained(folder)


def make_converted_checkpoint(folder: Path, tokenizer_dir: Path) -> None:
    """`scripts/convert_rannet_checkpoint.py` run on a random-weight `rannet` checkpoint of the test fixtures."""
    from ran_hf.integrations.convert_rannet import convert_rannet_checkpoint

    convert_rannet_checkpoint(ROOT / "tests" / "fixtures" / "rannet" / "l2_d24_w6_mean", folder)


STAND_INS = {
    "outputs/pipeline/tokenizer": make_tokenizer,
    "outputs/pipeline/classifier": make_classifier,
    "outputs/pipeline/mlm": make_masked_lm,
    "outputs/ran-clm": make_causal_lm,
    "outputs/ran-eurlex-titles": make_prefix_lm,
    "outputs/ran-20ng": make_sentence_transformers_classifier,
    "outputs/hyperpartisan-lora": make_lora_adapter,
    "ran-v3-en-base": make_converted_checkpoint,
}


def prepare_checkout(block: Block, tmp_path: Path, tokenizer_dir) -> Path:
    """The block's working directory, `tmp_path/checkout`, holding what its markers say it needs; skips the block
    if something it needs cannot be had here."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    if DATA_DIR.is_dir():  # ../shared/data from the checkout, as beside a real one
        (tmp_path / "shared").mkdir()
        (tmp_path / "shared" / "data").symlink_to(DATA_DIR, target_is_directory=True)
    for path, what in block.needs:
        sets = shared_data_sets(path)
        if sets is not None:
            if not data_available(*sets):
                pytest.skip(f"needs {path}: {what} (not found in {DATA_DIR})")
        elif path in STAND_INS:
            STAND_INS[path](checkout / path, tokenizer_dir())
        else:
            pytest.skip(f"needs {path}: {what}")
    return checkout


def imports_ran_hf(code: str) -> bool:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "ran_hf" for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "ran_hf":
            return True
    return False


# Runs a block read from stdin in a fresh interpreter, under the document's name, with the document's line numbers.
RUNNER = "import sys; exec(compile(sys.stdin.read(), sys.argv[1], 'exec'), {'__name__': '__main__'})"


@pytest.mark.parametrize("block", [python_case(block) for block in PYTHON_BLOCKS])
def test_python_block_runs(block, tmp_path, monkeypatch, request):
    if block.skip:
        pytest.skip(block.skip)
    for module in ("sentence_transformers", "peft", "onnx", "onnxruntime"):  # optional extras
        if re.search(rf"^\s*(from|import) {module}\b", block.code, re.MULTILINE):
            pytest.importorskip(module)
    checkout = prepare_checkout(block, tmp_path, lambda: request.getfixturevalue("stand_in_tokenizer_dir"))
    code = "\n" * block.line + block.code  # the block's first line is the line after the fence
    filename = str(ROOT / block.document)
    if imports_ran_hf(block.code):
        monkeypatch.chdir(checkout)
        exec(compile(code, filename, "exec"), {"__name__": "__main__"})
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        command = [sys.executable, "-c", RUNNER, filename]
        result = subprocess.run(
            command, input=code, cwd=checkout, env=env, capture_output=True, text=True, timeout=600
        )
        if result.returncode != 0:
            pytest.fail(f"{block.id} failed in a fresh interpreter:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")


@pytest.mark.parametrize("block", [pytest.param(block, id=block.id) for block in CONFIG_BLOCKS])
def test_config_block_parses(block):
    if block.language == "json":
        json.loads(block.code)
    else:
        yaml = pytest.importorskip("yaml")
        yaml.safe_load(block.code)


def test_markers_sit_above_python_blocks():
    assert not EXTRACTED.problems, "\n".join(EXTRACTED.problems)


def test_the_extractor_finds_every_known_block():
    counts = {}
    for block in PYTHON_BLOCKS:
        counts[block.document] = counts.get(block.document, 0) + 1
    fewer = {name: (counts.get(name, 0), known) for name, known in KNOWN_PYTHON_BLOCKS.items()}
    fewer = {name: found_known for name, found_known in fewer.items() if found_known[0] < found_known[1]}
    assert not fewer, f"python blocks (found, known) where the extractor found fewer than are known: {fewer}"
    assert len(CONFIG_BLOCKS) >= 3  # docs/training.md: fsdp_config.json, fsdp2.yaml, ds_zero2.json


def test_the_extractor_reads_fences_and_markers():
    text = "\n".join(
        [
            "text",
            "<!-- snippet: needs outputs/x: a folder -->",
            "<!-- snippet: slow -->",
            "```python",
            "print(1)",
            "```",
            "",
            "  ~~~py",
            "  x = 1",
            "  ~~~",
            "<!-- snippet: skip: no -->",
            "",
            "```bash",
            "<!-- snippet: needs inside: a code block is not read for markers -->",
            "```",
            "<!-- snippet: fast -->",
            "```python",
            "```",
        ]
    )
    found = extract(text, "doc.md")
    assert [(block.id, block.language, block.code) for block in found.blocks] == [
        ("doc.md:4", "python", "print(1)\n"),
        ("doc.md:8", "py", "x = 1\n"),
        ("doc.md:13", "bash", "<!-- snippet: needs inside: a code block is not read for markers -->\n"),
        ("doc.md:17", "python", ""),
    ]
    assert found.blocks[0].needs == (("outputs/x", "a folder"),) and found.blocks[0].slow
    assert found.problems == [
        "doc.md:11: snippet marker not directly above a code block: 'skip: no'",
        "doc.md:16: unknown snippet marker: 'fast'",
    ]
    assert data_sets(Block("d", 1, "python", "", (("../shared/data/hyperpartisan", "x"),))) == ["hyperpartisan"]
    assert data_sets(Block("d", 1, "python", "", (("../shared/data", "x"),))) == []
    assert data_sets(Block("d", 1, "python", "", (("outputs/x", "x"),))) is None
