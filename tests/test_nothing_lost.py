"""Nothing lost when writing output folders: the eight data-loss cases of issue 34, each reproduced and shown to be
refused or to succeed without loss, plus the folder writer (`ran_hf.files.folders`) on mount points and links.

Mount points are real: a tmpfs (and a bind mount) mounted here, which needs root; the tests that need one are
skipped with the reason otherwise.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import evaluate_perplexity
import export_onnx
import pytest
import run_classification
import run_pipeline
import train_embeddings
import train_tokenizer
from safetensors.torch import load_file

from ran_hf import RANConfig, RANForSequenceClassification, convert_rannet_checkpoint
from ran_hf.files.folder_locks import FolderInUseError, lock_folder
from ran_hf.files.folders import write_folder
from ran_hf.files.recovery import recover_interrupted


ROOT = Path(__file__).resolve().parents[1]
FILES = ROOT / "src" / "ran_hf" / "files"
# Takes the lock on argv[2] and holds it; loads ran_hf/files (argv[1]) alone, as a package of its own: the ran_hf
# package would import torch (seconds).
HOLD_LOCK = """
import importlib, importlib.util, sys, time
spec = importlib.util.spec_from_file_location("files", sys.argv[1] + "/__init__.py", submodule_search_locations=[sys.argv[1]])
sys.modules["files"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules["files"])
importlib.import_module("files.folder_locks").lock_folder(sys.argv[2])
print("locked", flush=True)
time.sleep(60)
"""
RANNET_FIXTURE = ROOT / "tests" / "fixtures" / "rannet" / "l1_d32_w4_last"
TINY_OVERRIDES = "hidden_size=16,num_attention_heads=2,head_dim=8,window_size=16,min_window_size=4"
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--log_level", "warning"]


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def mount(kind: str, point: Path, source: Path | None = None) -> None:
    """Mount a tmpfs (or bind `source`) at `point`, or skip the test saying why it cannot."""
    if os.geteuid() != 0:
        pytest.skip("mounting a file system needs root")
    point.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(point)]
    if kind == "bind":
        command = ["mount", "--bind", str(source), str(point)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount here ({' '.join(command)}: {result.stderr.strip()})")


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs mounted at tmp_path/volume for the test (a volume on another file system than tmp_path)."""
    point = tmp_path / "volume"
    mount("tmpfs", point)
    yield point
    subprocess.run(["umount", "-l", str(point)], check=True)


@pytest.fixture(scope="module")
def topic_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("topics")
    return run_pipeline.write_topic_documents(folder, {"train": 16, "validation": 4}, seed=1)


@pytest.fixture(scope="module")
def tokenizer_dir(topic_files, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer.main(
        ["--train_files", str(topic_files["train"]), "--vocab_size", "200", "--output_dir", str(folder)]
    )
    return folder


def classification_run(tokenizer_dir, topic_files, output_dir, *extra) -> list[str]:
    return [
        "--tokenizer_name",
        str(tokenizer_dir),
        "--config_overrides",
        TINY_OVERRIDES,
        "--train_file",
        str(topic_files["train"]),
        "--max_seq_length",
        "48",
        "--do_train",
        "--per_device_train_batch_size",
        "4",
        "--max_steps",
        "2",
        "--output_dir",
        str(output_dir),
        *extra,
        *QUIET,
    ]


def assert_no_leftovers(folder: Path) -> None:
    """No temporary folder or lock file of ours beside or inside `folder`."""
    for where in (folder.parent, folder):
        leftovers = [path.name for path in where.iterdir() if path.name.startswith(f".{folder.name}.")]
        assert not leftovers, leftovers


# ---- 1. the exporter over its own model ---------------------------------------------------------------------------


@pytest.fixture
def saved_model(tmp_path):
    config = RANConfig(
        vocab_size=50,
        hidden_size=16,
        num_attention_heads=2,
        head_dim=8,
        window_size=8,
        min_window_size=2,
        num_hidden_layers=1,
        num_labels=2,
    )
    folder = tmp_path / "model"
    RANForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("output", ["model.safetensors", "config.json", "link.onnx"])
def test_export_refuses_to_overwrite_a_file_of_its_model(saved_model, output):
    """`export_onnx.py --model_dir M --output M/model.safetensors` wrote the graph over the weights and exited 0. Now
    an --output that is not a .onnx file, or that is (through a link) a file the model is read from, is refused
    before the model is loaded."""
    (saved_model / "link.onnx").symlink_to(saved_model / "model.safetensors")
    before = files_of(saved_model)
    with pytest.raises(SystemExit) as exit_info:
        export_onnx.main(["--model_dir", str(saved_model), "--output", str(saved_model / output)])
    assert exit_info.value.code == 1
    assert files_of(saved_model) == before


def test_export_check_allows_a_new_graph_beside_the_model(saved_model):
    export_onnx.check_output(str(saved_model), str(saved_model / "model.onnx"))  # what the README does


@pytest.mark.parametrize("output", ["model.safetensors", "config.json", "../text.txt"])
def test_perplexity_results_are_not_written_over_what_the_run_reads(saved_model, output):
    """The same over-writing, found in the sweep: `evaluate_perplexity.py --output_file M/model.safetensors` (or the
    text it scores) wrote its JSON there after scoring. Now refused before the model is loaded."""
    text = saved_model.parent / "text.txt"
    text.write_text("a line of text\n", encoding="utf-8")
    before = files_of(saved_model.parent)
    argv = ["--model_name_or_path", str(saved_model), "--text_file", str(text)]
    with pytest.raises(ValueError, match=r"--output_file .* is --(model_name_or_path's|text_file)"):
        evaluate_perplexity.main([*argv, "--output_file", str(saved_model / output)])
    assert files_of(saved_model.parent) == before


def test_perplexity_results_may_go_beside_the_model(saved_model):
    args = evaluate_perplexity.PerplexityArguments(
        model_name_or_path=str(saved_model), text_file="text.txt", output_file=str(saved_model / "perplexity.json")
    )
    evaluate_perplexity.check_output_file(args)  # what the script's docstring does


# ---- 2. training from a checkpoint of the folder it overwrites ----------------------------------------------------


def test_a_run_does_not_delete_the_checkpoint_it_starts_from(tokenizer_dir, topic_files, tmp_path):
    """`--model_name_or_path OUT/checkpoint-2 --output_dir OUT --overwrite_output_dir` deleted every checkpoint of
    OUT, the starting one included, before reading it. Now an --output_dir holding an input is refused first."""
    output_dir = tmp_path / "run"
    run_classification.main(classification_run(tokenizer_dir, topic_files, output_dir, "--save_steps", "2"))
    before = files_of(output_dir)
    assert "checkpoint-2/model.safetensors" in before
    arguments = ["--model_name_or_path", str(output_dir / "checkpoint-2"), "--train_file", str(topic_files["train"])]
    arguments += ["--do_train", "--max_steps", "2", "--output_dir", str(output_dir), "--overwrite_output_dir", *QUIET]
    with pytest.raises(ValueError, match=r"--output_dir .*run holds --model_name_or_path .*checkpoint-2"):
        run_classification.main(arguments)
    assert files_of(output_dir) == before


def test_overwriting_keeps_the_old_checkpoints_until_the_new_model_is_saved(tokenizer_dir, topic_files, tmp_path):
    """--overwrite_output_dir no longer deletes the old checkpoints at the start: a run refused on its arguments leaves
    them, and a finished run deletes them only after its final save."""
    output_dir = tmp_path / "run"
    run_classification.main(classification_run(tokenizer_dir, topic_files, output_dir, "--save_steps", "2"))
    old = files_of(output_dir / "checkpoint-2")
    arguments = classification_run(
        tokenizer_dir, topic_files, output_dir, "--overwrite_output_dir", "--max_steps", "0"
    )
    with pytest.raises(ValueError, match="--max_steps"):  # refused before the folder is touched
        run_classification.main(arguments)
    assert files_of(output_dir / "checkpoint-2") == old
    run_classification.main(
        classification_run(tokenizer_dir, topic_files, output_dir, "--overwrite_output_dir", "--save_strategy", "no")
    )
    assert not (output_dir / "checkpoint-2").exists() and (output_dir / "model.safetensors").is_file()
    assert_no_leftovers(output_dir)


# ---- 3. an output folder that is a mount point ---------------------------------------------------------------------


def test_a_run_into_a_mount_point_keeps_its_model(tokenizer_dir, topic_files, tmpfs):
    """A volume as --output_dir: the final rename failed with EBUSY, the trained model was deleted with the staging
    folder and the log said the folder held what it held before. Now the volume's contents are replaced, twice."""
    run_classification.main(classification_run(tokenizer_dir, topic_files, tmpfs, "--save_strategy", "no"))
    first = load_file(tmpfs / "model.safetensors")
    assert os.path.ismount(tmpfs) and (tmpfs / "config.json").is_file()
    (tmpfs / "notes.txt").write_text("mine")  # not a run file: stays
    run_classification.main(
        classification_run(
            tokenizer_dir, topic_files, tmpfs, "--save_strategy", "no", "--overwrite_output_dir", "--seed", "7"
        )
    )
    second = load_file(tmpfs / "model.safetensors")
    assert any(not (first[name] == second[name]).all() for name in first)  # the new model, not the old one
    assert (tmpfs / "notes.txt").read_text() == "mine"
    assert_no_leftovers(tmpfs)


def test_write_folder_replaces_the_contents_of_a_bind_mount(tmp_path):
    """A bind mount on the same file system is no mount point to `os.path.ismount`, and its rename fails with
    EBUSY all the same; its contents are replaced."""
    source, point = tmp_path / "source", tmp_path / "bound"
    source.mkdir()
    (source / "old.txt").write_text("old")
    (source / "keep.txt").write_text("keep")
    mount("bind", point, source)
    try:
        with write_folder(point, "saving", carry_over=lambda name: name == "keep.txt") as staging:
            (staging / "new.txt").write_text("new")
        assert files_of(source) == {"keep.txt": b"keep", "new.txt": b"new"}
        assert os.path.ismount(point) or point.stat().st_ino == source.stat().st_ino
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)
    assert_no_leftovers(source)


def test_a_kill_while_a_mount_point_gets_new_contents_is_finished_by_the_next_run(tmpfs):
    """Killed after the old entries were set aside and the new folder marked ready: the next start moves the new
    entries in; killed before the mark, it puts the old entries back."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    pid = int(dead.stdout)
    (tmpfs / "kept.txt").write_text("kept")
    ready, previous = tmpfs / f".volume.ready-{pid}-a", tmpfs / f".volume.previous-{pid}-b"
    ready.mkdir(), previous.mkdir()
    (ready / "model.safetensors").write_text("new")
    (previous / "model.safetensors").write_text("old")
    recover_interrupted(tmpfs)
    assert files_of(tmpfs) == {"kept.txt": b"kept", "model.safetensors": b"new"}

    previous.mkdir()
    os.replace(tmpfs / "model.safetensors", previous / "model.safetensors")
    (tmpfs / f".volume.saving-{pid}-c").mkdir()
    recover_interrupted(tmpfs)
    assert files_of(tmpfs) == {"kept.txt": b"kept", "model.safetensors": b"new"}
    assert_no_leftovers(tmpfs)


# ---- 4. an output folder that is a link -----------------------------------------------------------------------------


def test_a_run_into_a_link_writes_the_folder_it_points_to(tokenizer_dir, topic_files, tmp_path):
    """On one file system the link was replaced by a real folder (the model landed off-target)."""
    target, link = tmp_path / "models" / "real", tmp_path / "link"
    target.mkdir(parents=True)
    link.symlink_to(target)
    run_classification.main(classification_run(tokenizer_dir, topic_files, link, "--save_strategy", "no"))
    assert link.is_symlink() and (target / "model.safetensors").is_file()
    assert_no_leftovers(target)
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []


def test_a_link_to_another_file_system_is_written_and_rewritten(tokenizer_dir, topic_files, tmp_path, tmpfs):
    """Across file systems: EXDEV after the new model was in place, the false "holds what it held before", and every
    later run crashed in `recover_interrupted`. Now the link's target is written, and written again."""
    target, link = tmpfs / "real", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    for extra in ([], ["--overwrite_output_dir"]):
        run_classification.main(classification_run(tokenizer_dir, topic_files, link, "--save_strategy", "no", *extra))
        assert link.is_symlink() and (target / "model.safetensors").is_file()
        assert_no_leftovers(target)
    assert recover_interrupted(link) == []


def test_a_link_to_a_mount_point_has_the_mount_points_contents_replaced(tmp_path, tmpfs):
    link = tmp_path / "link"
    link.symlink_to(tmpfs)
    (tmpfs / "old.txt").write_text("old")
    with write_folder(link, "saving") as staging:
        (staging / "new.txt").write_text("new")
    assert link.is_symlink() and files_of(tmpfs) == {"new.txt": b"new"}


# ---- 5. two runs into one folder ----------------------------------------------------------------------------------


def test_a_second_run_into_a_locked_folder_is_refused_naming_the_holder(tokenizer_dir, topic_files, tmp_path):
    """Two runs at once into one empty folder both exited 0, the second silently replacing the first. Now the second
    is refused at once, naming the first; once the first is gone (killed), its stale lock is taken over."""
    output_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(FILES), str(output_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FolderInUseError, match=rf"run is being written by process {holder.pid} on "):
            run_classification.main(classification_run(tokenizer_dir, topic_files, output_dir))
        assert not output_dir.exists()
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / ".run.lock").exists()  # left by the killed holder
    run_classification.main(classification_run(tokenizer_dir, topic_files, output_dir, "--save_strategy", "no"))
    assert (output_dir / "model.safetensors").is_file() and not (tmp_path / ".run.lock").exists()


def test_a_lock_is_shared_within_a_process_and_released(tmp_path):
    first = lock_folder(tmp_path / "out")
    assert lock_folder(tmp_path / "out") is first
    first.release()
    assert (tmp_path / ".out.lock").exists()
    first.release()
    assert not (tmp_path / ".out.lock").exists()


# ---- 6. a tokenizer over a trained model's ------------------------------------------------------------------------


def test_a_tokenizer_is_not_trained_over_a_models_tokenizer(tokenizer_dir, topic_files, tmp_path):
    """`train_tokenizer.py --output_dir <a trained model's folder>` replaced the model's tokenizer with one of
    another vocabulary. Now it is refused; with --overwrite_output_dir only the tokenizer files are replaced."""
    model_dir = tmp_path / "model"
    shutil.copytree(tokenizer_dir, model_dir)
    (model_dir / "model.safetensors").write_bytes(b"weights")
    before = files_of(model_dir)
    arguments = ["--train_files", str(topic_files["train"]), "--vocab_size", "120", "--output_dir", str(model_dir)]
    with pytest.raises(ValueError, match=r"--output_dir .*model already holds files .*--overwrite_output_dir"):
        train_tokenizer.main(arguments)
    assert files_of(model_dir) == before
    train_tokenizer.main([*arguments, "--overwrite_output_dir"])
    assert (model_dir / "model.safetensors").read_bytes() == b"weights"
    assert (model_dir / "tokenizer.json").read_bytes() != before["tokenizer.json"]
    assert_no_leftovers(model_dir)


# ---- 7. sentence embeddings twice into one folder -------------------------------------------------------------------


def test_train_embeddings_does_not_replace_a_previous_run(tokenizer_dir, topic_files, tmp_path):
    """A second `train_embeddings.py` into a folder with finished models replaced them without a word. Now it is
    refused before any work unless --overwrite_output_dir."""
    output_dir = tmp_path / "embeddings"
    (output_dir / "ran-mean").mkdir(parents=True)
    (output_dir / "ran-mean" / "model.safetensors").write_bytes(b"finished")
    (output_dir / "results.json").write_text("{}")
    before = files_of(output_dir)
    with pytest.raises(ValueError, match=r"already holds a previous run \(ran-mean, results.json\)"):
        train_embeddings.main(
            [
                "--tokenizer_name",
                str(tokenizer_dir),
                "--train_file",
                str(topic_files["train"]),
                "--test_file",
                str(topic_files["validation"]),
                "--output_dir",
                str(output_dir),
            ]
        )
    assert files_of(output_dir) == before


# ---- the same kinds, found in the sweep: quickstart.py ------------------------------------------------------------


def test_quickstart_does_not_save_over_another_folder(tmp_path, capsys):
    """`quickstart.py --output_dir` saved its untrained model into any folder (a trained model's, say) over what was
    there. Now a folder holding anything but an earlier quickstart's model is refused before any work."""
    import quickstart

    output_dir = tmp_path / "trained-model"
    output_dir.mkdir()
    (output_dir / "model.safetensors").write_bytes(b"trained weights")
    with pytest.raises(SystemExit):
        quickstart.main(["--output_dir", str(output_dir)])
    assert "holds files that an earlier quickstart did not write (model.safetensors)" in capsys.readouterr().err
    assert files_of(output_dir) == {"model.safetensors": b"trained weights"}
    assert_no_leftovers(output_dir)


def test_quickstart_replaces_its_own_output_whole(tmp_path):
    import quickstart

    text = tmp_path / "text.txt"
    text.write_text("the model reads long documents window by window .\n" * 40, encoding="utf-8")
    output_dir = tmp_path / "quickstart"
    argv = ["--text_file", str(text), "--output_dir", str(output_dir), "--vocab_size", "60", "--max_tokens", "64"]
    quickstart.main(argv)
    first = files_of(output_dir)
    quickstart.main([*argv, "--seed", "1"])  # an earlier quickstart's folder: replaced without asking
    assert set(files_of(output_dir)) == set(first) and files_of(output_dir) != first
    assert json.loads((output_dir / "quickstart.json").read_text())["tokens"] == 64
    assert_no_leftovers(output_dir)


# ---- 8. the converter over the checkpoint it converts ---------------------------------------------------------------


def test_the_converter_refuses_an_output_holding_its_checkpoint(tmp_path):
    """A `checkpoint` file whose model_checkpoint_path points into --output_dir: --overwrite deleted the checkpoint
    data being converted. Now refused, overwrite or not, before anything is read or written."""
    rannet_dir, output_dir = tmp_path / "rannet", tmp_path / "out"
    shutil.copytree(RANNET_FIXTURE, rannet_dir)
    output_dir.mkdir()
    for path in rannet_dir.glob("model.ckpt.*"):
        shutil.move(path, output_dir / path.name)
    (rannet_dir / "checkpoint").write_text(f'model_checkpoint_path: "{output_dir / "model.ckpt"}"\n')
    before = files_of(output_dir)
    with pytest.raises(ValueError, match=r"output_dir .*out holds the TensorFlow checkpoint file .*model\.ckpt"):
        convert_rannet_checkpoint(rannet_dir, output_dir, overwrite=True)
    assert files_of(output_dir) == before
    assert_no_leftovers(output_dir)


def test_write_folder_keeps_a_new_folder_it_cannot_put_in_place(tmp_path, monkeypatch):
    """A failed final move deleted the new content; now it is kept under a visible name, which the error gives."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    replace = os.replace

    def full_disk(source, destination):
        if Path(source).name.startswith(".out.saving-") and Path(destination) == target:
            raise OSError(28, "No space left on device")
        replace(source, destination)

    monkeypatch.setattr(os, "replace", full_disk)
    new_content_kept = pytest.raises(OSError, match=r"the new content is complete in .*out\.new-")
    with new_content_kept, write_folder(target, "saving") as staging:
        (staging / "new.txt").write_text("new")
    monkeypatch.setattr(os, "replace", replace)
    (kept,) = tmp_path.glob("out.new-*")
    assert files_of(kept) == {"new.txt": b"new"} and files_of(target) == {"old.txt": b"old"}


# ---- round three (issue 46): a user's files, the library's exporter, runs an overwrite replaced ---------------------


def test_quickstart_keeps_a_users_file_in_its_earlier_output(tmp_path):
    """Re-running quickstart.py into its own earlier output deleted a user's `my_notes.txt` there (exit 0, no word).
    Now the folder is written as the training scripts write theirs: the model and tokenizer are replaced, other
    entries stay."""
    import quickstart

    text = tmp_path / "text.txt"
    text.write_text("the model reads long documents window by window .\n" * 40, encoding="utf-8")
    output_dir = tmp_path / "quickstart"
    argv = ["--text_file", str(text), "--output_dir", str(output_dir), "--vocab_size", "60", "--max_tokens", "64"]
    quickstart.main(argv)
    first = files_of(output_dir)
    (output_dir / "my_notes.txt").write_text("what I found")
    (output_dir / "plots").mkdir()
    (output_dir / "plots" / "loss.png").write_bytes(b"a plot")
    quickstart.main([*argv, "--seed", "1"])
    after = files_of(output_dir)
    assert after["my_notes.txt"] == b"what I found" and after["plots/loss.png"] == b"a plot"
    assert set(after) == set(first) | {"my_notes.txt", "plots/loss.png"}
    assert after["model.safetensors"] != first["model.safetensors"]
    assert_no_leftovers(output_dir)


def test_the_converter_keeps_a_users_file_when_overwriting(tmp_path):
    """`convert_rannet_checkpoint.py --overwrite` over its earlier output deleted a user's `notes.txt`. Now the
    converted model's files are replaced and the rest stays, as the training scripts do; a stale file of the old
    model (weights in another format, sentence-transformers' settings) does not."""
    import convert_rannet_checkpoint as converter_script

    output_dir = tmp_path / "converted"
    argv = ["--rannet_dir", str(RANNET_FIXTURE), "--output_dir", str(output_dir)]
    converter_script.main(argv)
    first = files_of(output_dir)
    (output_dir / "notes.txt").write_text("where the checkpoint came from")
    (output_dir / "pytorch_model.bin").write_bytes(b"weights of an older model")
    (output_dir / "modules.json").write_text("[]")
    converter_script.main([*argv, "--overwrite"])
    after = files_of(output_dir)
    assert after.pop("notes.txt") == b"where the checkpoint came from"
    assert after == first
    assert_no_leftovers(output_dir)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "weights.bin", "link.onnx", "not-onnx.onnx"])
def test_the_library_exporter_refuses_to_write_over_what_is_not_its_graph(saved_model, name):
    """`ran_hf.export_onnx(model, "<dir>/model.safetensors")` replaced the weights with the ONNX graph: only the
    script checked its --output. Now the function refuses, before exporting, a path that is not a `.onnx` file or
    that holds something other than an ONNX graph (through a link too)."""
    from ran_hf import export_onnx as export_library

    (saved_model / "link.onnx").symlink_to(saved_model / "model.safetensors")
    (saved_model / "not-onnx.onnx").write_text('{"my": "settings"}')
    before = files_of(saved_model)
    model = RANForSequenceClassification.from_pretrained(saved_model)
    with pytest.raises(ValueError, match=rf"{saved_model / name}.* (is not a \.onnx file|is not an ONNX graph)"):
        export_library(model, saved_model / name)
    assert files_of(saved_model) == before
    assert not [path for path in saved_model.parent.iterdir() if path.name.startswith(".")]


def test_the_exporter_script_refuses_a_file_that_is_not_an_onnx_graph(saved_model):
    (saved_model / "settings.onnx").write_text('{"my": "settings"}')
    with pytest.raises(ValueError, match=r"settings\.onnx .*is not an ONNX graph"):
        export_onnx.check_output(str(saved_model), str(saved_model / "settings.onnx"))


def rename_to_a_finished_process(folder: Path) -> None:
    """What a SIGKILL leaves: this process's temporary folders beside or inside `folder`, under a pid that is gone."""
    dead = finished_process_id()
    for where in (folder.parent, folder):
        for path in list(where.iterdir()) if where.is_dir() else []:
            if path.name.startswith(f".{folder.name}.") and f"-{os.getpid()}-" in path.name:
                path.rename(path.with_name(path.name.replace(f"-{os.getpid()}-", f"-{dead}-")))


def finished_process_id() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


class Killed(BaseException):
    """Stands for SIGKILL: nothing catches it, so only `finally` blocks run."""


@pytest.mark.slow
def test_a_killed_overwrite_resumes_its_own_run_not_the_old_one(
    tokenizer_dir, topic_files, tmp_path, monkeypatch, caplog
):
    """An old run with checkpoints 1 to 5; a new run with --overwrite_output_dir killed after its checkpoint 1; then
    `--resume_from_checkpoint latest`. The old run's checkpoints came back beside the new one's and resume continued
    the *old* run from its checkpoint 5. Now the old checkpoints are retired before the new run writes one: a kill
    never brings them back, `latest` continues the new run from its checkpoint 1, and they are deleted once that
    run's model is saved."""
    import transformers

    output_dir = tmp_path / "run"
    old_run = classification_run(tokenizer_dir, topic_files, output_dir, "--max_steps", "5", "--save_steps", "1")
    run_classification.main(old_run)
    old = files_of(output_dir)
    assert {name.split("/")[0] for name in old if name.startswith("checkpoint-")} == {
        f"checkpoint-{step}" for step in range(1, 6)
    }

    new_run = classification_run(
        tokenizer_dir, topic_files, output_dir, "--max_steps", "5", "--save_steps", "1", "--seed", "7"
    )
    save_checkpoint = transformers.Trainer._save_checkpoint

    def killed_after_the_first_checkpoint(self, *args, **kwargs):
        save_checkpoint(self, *args, **kwargs)
        if self.state.global_step == 1:
            raise Killed

    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", killed_after_the_first_checkpoint)
    with pytest.raises(Killed):
        run_classification.main([*new_run, "--overwrite_output_dir"])
    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", save_checkpoint)
    rename_to_a_finished_process(output_dir)
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-1"]
    new_checkpoint = files_of(output_dir / "checkpoint-1")

    with caplog.at_level("INFO"):
        results = run_classification.main([*new_run, "--resume_from_checkpoint", "latest"])
    assert f"Resuming from {output_dir / 'checkpoint-1'}" in caplog.text
    assert results["train"]["train_samples"] > 0
    after = files_of(output_dir)
    assert {name: after[f"checkpoint-1/{name}"] for name in new_checkpoint} == new_checkpoint
    assert json.loads(after["trainer_state.json"])["global_step"] == 5
    for step in range(2, 6):  # the new run's, not the old run's
        assert after[f"checkpoint-{step}/model.safetensors"] != old[f"checkpoint-{step}/model.safetensors"]
    assert [path.name for path in tmp_path.iterdir()] == ["run"]  # the retired checkpoints are gone now


def test_retired_entries_are_never_put_back_and_go_with_the_next_save(tmp_path):
    """The folder writer's side of it: what `set_aside` moved away stays away after a kill (`recover_interrupted`
    names it and leaves it), is put back by the process itself when it fails before it `retire_set_aside`s, and is
    deleted by the next completed save's `discard_set_aside`."""
    from ran_hf.files import recovery

    target = tmp_path / "run"
    for name in ("checkpoint-4", "checkpoint-5"):
        (target / name).mkdir(parents=True)
        (target / name / "trainer_state.json").write_text(name)
    recovery.set_aside(target, ["checkpoint-4", "checkpoint-5"])
    recovery.restore_set_aside(target)  # failed before writing anything of its own: put back
    assert sorted(files_of(target)) == ["checkpoint-4/trainer_state.json", "checkpoint-5/trainer_state.json"]
    assert [path.name for path in tmp_path.iterdir()] == ["run"]

    recovery.set_aside(target, ["checkpoint-4", "checkpoint-5"])
    recovery.retire_set_aside(target)
    (target / "checkpoint-1").mkdir()
    recovery.restore_set_aside(target)  # failed after writing: the old entries stay retired
    assert [path.name for path in target.iterdir()] == ["checkpoint-1"]
    rename_to_a_finished_process(target)
    (retired,) = [path for path in tmp_path.iterdir() if path.name != "run"]
    assert retired.name.startswith(".run.retired-")
    notes = recovery.recover_interrupted(target, carry_over=lambda name: True)
    assert [path.name for path in target.iterdir()] == ["checkpoint-1"]
    assert any(str(retired) in note and "checkpoint-4, checkpoint-5" in note for note in notes), notes
    recovery.discard_set_aside(target)  # the next completed save
    assert [path.name for path in tmp_path.iterdir()] == ["run"]


@pytest.mark.slow
def test_latest_skips_a_checkpoint_a_kill_left_half_rewritten(
    tokenizer_dir, topic_files, tmp_path, monkeypatch, caplog
):
    """A run resumed from checkpoint-2 of a folder that also holds checkpoint-4 saves checkpoint-4 again, in place.
    Killed after the new weights and before the new optimizer state, the folder held the new weights beside the old
    optimizer, scheduler, RNG and trainer state, every file intact: `latest` took it. Now the old trainer state is
    removed first, so that such a folder is incomplete and `latest` skips it."""
    import transformers

    output_dir = tmp_path / "run"
    argv = classification_run(tokenizer_dir, topic_files, output_dir, "--max_steps", "4", "--save_steps", "2")
    run_classification.main(argv)
    save_optimizer = transformers.Trainer._save_optimizer_and_scheduler

    def killed_while_saving_checkpoint_4(self, output_dir):
        if output_dir.endswith("checkpoint-4"):
            raise Killed
        save_optimizer(self, output_dir)

    monkeypatch.setattr(transformers.Trainer, "_save_optimizer_and_scheduler", killed_while_saving_checkpoint_4)
    with pytest.raises(Killed):
        run_classification.main(
            [*argv, "--learning_rate", "1e-3", "--resume_from_checkpoint", str(output_dir / "checkpoint-2")]
        )
    monkeypatch.setattr(transformers.Trainer, "_save_optimizer_and_scheduler", save_optimizer)
    with caplog.at_level("INFO"):
        run_classification.main([*argv, "--learning_rate", "1e-3", "--resume_from_checkpoint", "latest"])
    assert f"Skipping {output_dir / 'checkpoint-4'}: it lacks a readable trainer_state.json" in caplog.text
    assert f"Resuming from {output_dir / 'checkpoint-2'}" in caplog.text


# ---- a truncated weights file is named --------------------------------------------------------------------------


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_truncated_weights_file_is_named_by_from_pretrained(saved_model):
    """`from_pretrained` on a folder whose model.safetensors a full disk or a killed copy cut raised safetensors'
    "incomplete metadata, file not fully covered", without saying which file. Now the error names it and says why."""
    from transformers import AutoModelForSequenceClassification

    weights = saved_model / "model.safetensors"
    cut_in_half(weights)
    damaged = rf"{weights} .*is damaged or cut short \(incomplete metadata"
    with pytest.raises(OSError, match=damaged):
        RANForSequenceClassification.from_pretrained(saved_model)
    with pytest.raises(OSError, match=damaged):
        AutoModelForSequenceClassification.from_pretrained(saved_model)
    with pytest.raises(SystemExit) as exit_info:
        export_onnx.main(["--model_dir", str(saved_model), "--output", str(saved_model / "model.onnx")])
    assert exit_info.value.code == 1


def test_a_training_script_names_a_truncated_weights_file(tokenizer_dir, topic_files, tmp_path):
    model_dir = tmp_path / "model"
    run_classification.main(classification_run(tokenizer_dir, topic_files, model_dir, "--save_strategy", "no"))
    cut_in_half(model_dir / "model.safetensors")
    argv = ["--model_name_or_path", str(model_dir), "--train_file", str(topic_files["train"]), "--do_train"]
    argv += ["--max_steps", "1", "--output_dir", str(tmp_path / "out"), *QUIET]
    with pytest.raises(OSError, match=rf"{model_dir / 'model.safetensors'} .*is damaged or cut short"):
        run_classification.main(argv)


def test_an_out_of_vocabulary_id_is_answered_with_the_fix():
    """An id past the vocabulary (a tokenizer that is not the model's, or tokens added without resizing) was named
    with the vocabulary's range only; the error now says what to do."""
    import torch

    from ran_hf import RANModel

    model = RANModel(RANConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8, vocab_size=61))
    with pytest.raises(ValueError, match=r"token id 70, outside the vocabulary \[0, 60\]: .*resize_token_embeddings"):
        model(torch.tensor([[1, 70]]))


def test_cropping_a_cache_says_how_to_go_back():
    """`cache.crop(n)` was refused without a way back; the error now names keeping a `copy.deepcopy` or a fresh
    cache."""
    import torch

    from ran_hf import RANForCausalLM

    config = RANConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8, vocab_size=61,
                       window_size=4, min_window_size=2, is_causal=True)  # fmt: skip
    model = RANForCausalLM(config).eval()
    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3, 4, 5]]), use_cache=True).past_key_values
    for target in (cache, cache.layers[0]):
        with pytest.raises(ValueError, match=r"cannot be cropped.*copy\.deepcopy\(cache\).*fresh cache"):
            target.crop(2)
