"""Nothing outside the folder changes when a model, a config or sentence-transformers' files are saved into it: a
name there that is a symbolic link to a file elsewhere is replaced by the saved file, never written through; a save
that stops halfway (an exception, a kill, the file-size limit) leaves the earlier folder as it was, and the limit's
error names the folder, the file and the cause (`ran_hf.safe_writes.write_into`, the writer of every file the package
saves)."""

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ran_testing import tiny_config
from safetensors.torch import load_file

from ran_hf import (
    RANConfig,
    RANForCausalLM,
    RANForMaskedLM,
    RANForQuestionAnswering,
    RANForSequenceClassification,
    RANForTokenClassification,
    RANModel,
)
from ran_hf.files.folders import write_folder
from ran_hf.files.paths import keeps_user_files
from ran_hf.files.recovery import recover_interrupted
from ran_hf.files.safe_writes import WriteStoppedError, write_into
from ran_hf.integrations.sentence_embeddings import write_sentence_transformers_config


HEADS = {
    "base": (RANModel, {}),
    "masked-lm": (RANForMaskedLM, {}),
    "classifier": (RANForSequenceClassification, {"num_labels": 3}),
    "tagger": (RANForTokenClassification, {"num_labels": 3}),
    "qa": (RANForQuestionAnswering, {}),
    "causal-lm": (RANForCausalLM, {"is_causal": True}),
}


def build(head: str, seed: int = 0):
    model_class, fields = HEADS[head]
    torch.manual_seed(seed)
    return model_class(tiny_config(**fields)).eval()


def digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (links not followed) with a hash of what it holds."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            found[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def link_every_name(target: Path, names, outside: Path) -> dict[str, bytes]:
    """Make each of `names` in `target` a link to a file of its own in `outside`; return what those files hold."""
    outside.mkdir(exist_ok=True)
    target.mkdir(exist_ok=True)
    held = {}
    for name in names:
        (outside / name).write_bytes(held.setdefault(name, f"not RAN's: {name}\n".encode()))
        (target / name).unlink(missing_ok=True)
        (target / name).symlink_to(outside / name)
    return held


def assert_unchanged(outside: Path, held: dict[str, bytes]) -> None:
    changed = [name for name, content in held.items() if (outside / name).read_bytes() != content]
    assert not changed, f"written through a link: {changed}"


@pytest.mark.parametrize("head", list(HEADS))
def test_a_link_in_the_folder_is_replaced_and_what_it_points_to_kept(head, tmp_path, caplog):
    model = build(head)
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    names = sorted(os.listdir(plain))  # every file this head's save writes
    assert {"config.json", "model.safetensors", "modeling_ran.py", "configuration_ran.py", "ran_layer.py"} <= set(
        names
    )
    if head == "causal-lm":
        assert "generation_config.json" in names

    target, outside = tmp_path / "target", tmp_path / "outside"
    held = link_every_name(target, names, outside)
    model.save_pretrained(target)

    assert_unchanged(outside, held)
    assert not [name for name in names if (target / name).is_symlink()]
    assert digest(target) == digest(plain)  # the folder holds the save, as a fresh folder would
    assert "a link is never written through" in caplog.text and str(outside / "config.json") in caplog.text
    loaded = type(model).from_pretrained(target)
    ids = torch.tensor([[3, 5, 7, 9, 11, 2]])
    torch.testing.assert_close(loaded(ids)[0], model(ids)[0])


def test_a_config_alone_replaces_its_links(tmp_path):
    config = tiny_config()
    config.architectures = ["RANModel"]  # a model's config: its code is saved too
    target, outside = tmp_path / "target", tmp_path / "outside"
    names = ["config.json", "configuration_ran.py", "modeling_ran.py", "saved_code.py", "safe_writes.py"]
    held = link_every_name(target, names, outside)
    (target / "notes.txt").write_text("mine")

    config.save_pretrained(target)

    assert_unchanged(outside, held)
    assert not any((target / name).is_symlink() for name in names)
    assert (target / "notes.txt").read_text() == "mine"  # what the save does not write stays
    assert RANConfig.from_pretrained(target).hidden_size == config.hidden_size


def test_a_folder_given_as_a_link_is_saved_where_it_points(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    build("base").save_pretrained(tmp_path / "alias")
    assert (real / "config.json").is_file() and (tmp_path / "alias").is_symlink()


def test_sentence_transformers_files_replace_their_links(tmp_path):
    folder, outside = tmp_path / "model", tmp_path / "outside"
    build("classifier").save_pretrained(folder)
    names = ["modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"]
    held = link_every_name(folder, names, outside)
    pooling_outside = tmp_path / "pooling_elsewhere"
    pooling_outside.mkdir()
    (pooling_outside / "config.json").write_text("not RAN's")
    (folder / "1_Pooling").symlink_to(pooling_outside, target_is_directory=True)

    write_sentence_transformers_config(folder, pooling="mean")  # writes 1_Pooling/config.json

    assert_unchanged(outside, held)
    assert (pooling_outside / "config.json").read_text() == "not RAN's"
    assert not (folder / "1_Pooling").is_symlink() and (folder / "1_Pooling" / "config.json").is_file()

    (folder / "1_Pooling").rename(tmp_path / "old_pooling")
    (folder / "1_Pooling").symlink_to(pooling_outside, target_is_directory=True)
    write_sentence_transformers_config(folder, pooling="pooled_cell")  # a cell choice drops the pooling module
    assert not os.path.lexists(folder / "1_Pooling")
    assert (pooling_outside / "config.json").read_text() == "not RAN's"


def test_a_script_save_keeps_the_tokenizers_links_targets(tmp_path):
    """The scripts save the model and the tokenizer into a `write_folder` staging, which replaces the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    plain = tmp_path / "plain"
    tokenizer.save_pretrained(plain)
    build("classifier").save_pretrained(plain)

    target, outside = tmp_path / "target", tmp_path / "outside"
    held = link_every_name(target, sorted(os.listdir(plain)), outside)
    with write_folder(target, "saving", carry_over=keeps_user_files) as staging:
        build("classifier").save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    assert_unchanged(outside, held)
    assert not any(path.is_symlink() for path in target.iterdir())
    assert PreTrainedTokenizerFast.from_pretrained(target)("a b")["input_ids"] == [2, 3]


def test_a_shard_that_is_a_link_is_removed_not_followed_and_stale_shards_go(tmp_path):
    model, folder, outside = build("base"), tmp_path / "model", tmp_path / "outside"
    model.save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(name for name in os.listdir(folder) if name.startswith("model-000"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    held = link_every_name(folder, [shards[-1]], outside)

    model.save_pretrained(folder)  # in one file: the earlier shards go, as Transformers' own save removes them

    assert_unchanged(outside, held)
    assert not [name for name in os.listdir(folder) if name.startswith("model-000")]
    torch.testing.assert_close(load_file(folder / "model.safetensors"), model.state_dict(), check_device=False)


def test_a_save_that_raises_midway_leaves_the_earlier_folder(tmp_path, monkeypatch):
    import transformers.modeling_utils

    folder = tmp_path / "model"
    first = build("classifier", seed=0)
    first.save_pretrained(folder)
    before = digest(folder)

    def half_written(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # what a stopped write leaves
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", half_written)
    with pytest.raises(KeyboardInterrupt):
        build("classifier", seed=1).save_pretrained(folder)

    assert digest(folder) == before
    assert sorted(os.listdir(folder)) == sorted(before)  # no temporary folder left
    loaded = RANForSequenceClassification.from_pretrained(folder)
    torch.testing.assert_close(loaded.state_dict(), first.state_dict())


def test_an_existing_folder_named_like_a_saved_file_is_refused_before_anything_moves(tmp_path):
    folder = tmp_path / "model"
    build("base").save_pretrained(folder)
    before = digest(folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    (folder / "model.safetensors" / "mine.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"model\.safetensors is a folder.*Move it away"):
        build("base", seed=1).save_pretrained(folder)
    assert (folder / "model.safetensors" / "mine.txt").read_text() == "mine"
    kept = {name: value for name, value in before.items() if name != "model.safetensors"}
    assert digest(folder) == {**kept, "model.safetensors/mine.txt": digest(folder)["model.safetensors/mine.txt"]}


SAVE_THEN = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    from ran_testing import tiny_config
    from ran_hf import RANForSequenceClassification
    import ran_hf.files.safe_writes as safe_writes
    import transformers.modeling_utils
    torch.manual_seed(1)
    model = RANForSequenceClassification(tiny_config(num_labels=3))
    {patch}
    model.save_pretrained({folder!r})
    """
)
KILL_WHILE_WRITING = """
def killed(tensors, filename, metadata=None):
    open(filename, "wb").write(b"half")
    os.kill(os.getpid(), signal.SIGKILL)
transformers.modeling_utils.safe_save_file = killed
"""
KILL_AMONG_RENAMES = """
move_entry = safe_writes.move_entry
def killed_after_two(entry, destination, moved=[]):
    if destination.parent.name == "model":  # the folder saved into, not a nested save's temporary folder
        if len(moved) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        moved.append(entry)
    return move_entry(entry, destination)
safe_writes.move_entry = killed_after_two
"""


def run_killed(folder: Path, patch: str) -> None:
    script = SAVE_THEN.format(tests=str(Path(__file__).parent), patch=patch, folder=str(folder))
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert completed.returncode == -signal.SIGKILL, completed.stderr[-3000:]


@pytest.mark.slow
def test_a_save_killed_while_writing_leaves_the_earlier_folder_and_is_cleaned_up(tmp_path):
    folder = tmp_path / "model"
    first = build("classifier", seed=0)
    first.save_pretrained(folder)
    before = digest(folder)

    run_killed(folder, KILL_WHILE_WRITING)

    leftovers = [name for name in os.listdir(folder) if name.startswith(".model.saving-")]
    assert len(leftovers) == 1  # the killed save's own, apart from the folder's files
    assert {name: value for name, value in digest(folder).items() if not name.startswith(".")} == before
    torch.testing.assert_close(RANForSequenceClassification.from_pretrained(folder).state_dict(), first.state_dict())
    build("classifier", seed=2).save_pretrained(folder)  # the next save deletes what the killed one left
    assert not [name for name in os.listdir(folder) if name.startswith(".")]


@pytest.mark.slow
def test_a_save_killed_among_its_renames_is_finished_by_the_next_run(tmp_path):
    folder = tmp_path / "model"
    build("classifier", seed=0).save_pretrained(folder)

    run_killed(folder, KILL_AMONG_RENAMES)

    assert [name for name in os.listdir(folder) if name.startswith(".model.ready-")]
    notes = recover_interrupted(folder)  # what a script run does first (a later save does the same)
    assert any("moved the new entries" in note for note in notes)
    torch.manual_seed(1)
    second = RANForSequenceClassification(tiny_config(num_labels=3))
    torch.testing.assert_close(RANForSequenceClassification.from_pretrained(folder).state_dict(), second.state_dict())
    assert not [name for name in os.listdir(folder) if name.startswith(".")]


LIMITED_SAVE = textwrap.dedent(
    """
    import json, resource, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    from ran_testing import tiny_config
    from ran_hf import RANForSequenceClassification
    from ran_hf.files.folders import write_folder
    torch.manual_seed(1)
    model = RANForSequenceClassification(tiny_config(num_labels=3, vocab_size=4000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, not the process
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        if {through_script}:
            with write_folder({folder!r}, "saving") as staging:
                model.save_pretrained(staging)
        else:
            model.save_pretrained({folder!r})
    except OSError as error:
        print(json.dumps({{"type": type(error).__name__, "errno": error.errno, "message": str(error)}}))
    """
)


def limited_save(folder: Path, limit: int, through_script: bool = False) -> dict:
    import json

    script = LIMITED_SAVE.format(
        tests=str(Path(__file__).parent), limit=limit, folder=str(folder), through_script=through_script
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.strip().splitlines()
    assert lines, f"the save did not fail under a {limit}-byte limit: {completed.stderr[-2000:]}"
    return json.loads(lines[-1])


@pytest.mark.slow
@pytest.mark.parametrize("through_script", [False, True], ids=["save_pretrained", "write_folder"])
def test_the_file_size_limit_is_named_with_the_folder_and_the_folder_kept(tmp_path, through_script):
    folder = tmp_path / "model"
    torch.manual_seed(0)
    first = RANForSequenceClassification(tiny_config(num_labels=3, vocab_size=4000))
    first.save_pretrained(folder)
    before = digest(folder)
    weights = (folder / "model.safetensors").stat().st_size
    limit = weights // 2  # the config and the code fit, the weights do not
    assert max(os.path.getsize(folder / name) for name in before if name != "model.safetensors") < limit

    error = limited_save(folder, limit, through_script)

    assert error["type"] == "WriteStoppedError" and error["errno"] == errno.EFBIG
    message = error["message"]
    assert f"Saving into {folder} stopped" in message and "weights" in message
    assert f"{limit:,} bytes" in message and "ulimit -f" in message and "max_shard_size" in message
    assert ".saving-" not in message  # the folder the user gave, not a temporary one
    assert digest(folder) == before and sorted(os.listdir(folder)) == sorted(before)
    torch.testing.assert_close(RANForSequenceClassification.from_pretrained(folder).state_dict(), first.state_dict())


@pytest.mark.slow
def test_a_small_file_cut_short_by_the_limit_is_named(tmp_path):
    error = limited_save(tmp_path / "model", limit=2000)  # the code files are larger
    assert error["type"] == "WriteStoppedError" and error["errno"] == errno.EFBIG
    assert f"while writing {tmp_path / 'model'}/" in error["message"] and ".py" in error["message"]
    assert not (tmp_path / "model").exists()  # a new folder appears complete or not at all
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".model.")]


def test_a_stopped_write_is_named_for_the_folder_given_not_the_temporary_one(tmp_path):
    folder = tmp_path / "model"
    with pytest.raises(WriteStoppedError, match="No space left on device: a full disk") as raised:
        with write_into(folder) as staging:
            (staging / "big.bin").write_bytes(b"x")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(folder) in str(raised.value) and "free space" in str(raised.value)
    assert isinstance(raised.value, OSError) and raised.value.errno == errno.ENOSPC
    assert not folder.exists()


def test_a_hard_link_keeps_its_other_name_and_a_replaced_file_its_permissions(tmp_path):
    folder = tmp_path / "model"
    build("base").save_pretrained(folder)
    (folder / "config.json").chmod(0o600)
    elsewhere = tmp_path / "shared_config.json"
    os.link(folder / "config.json", elsewhere)
    before = elsewhere.read_bytes()

    RANModel(tiny_config(hidden_dropout_prob=0.25)).save_pretrained(folder)  # a config that differs

    assert elsewhere.read_bytes() == before != (folder / "config.json").read_bytes()
    assert (folder / "config.json").stat().st_ino != elsewhere.stat().st_ino
    assert oct((folder / "config.json").stat().st_mode & 0o777) == oct(0o600)
