"""The long-context benchmark: passkey and MQAR examples say what they claim, answers are read where they are asked,
and one tiny run of every model writes its table and plot."""

import json
from pathlib import Path

import benchmark_long_context as bench
import pytest
import torch
from benchmark_long_context import KEY, QUESTION, Vocabulary, answer_logits, mqar_batch, passkey_batch
from benchmark_utils import check_result
from conftest import DATA_DIR as DATA
from saved_plots import assert_png_of, record_saved_figures
from transformers import AutoConfig


needs_data = pytest.mark.needs_data("wikitext-2")  # the benchmark's filler text


@pytest.fixture(scope="module")
def streams():
    words = ("the cat sat on the mat , and 1990 was a year . " * 20_000).split()
    vocabulary = Vocabulary(words)
    return vocabulary.encode(words), vocabulary


def test_vocabulary_keeps_digits_for_keys_only(streams):
    stream, vocabulary = streams
    assert stream.min() >= vocabulary.first_word  # no filler token is a key digit or a marker
    assert (stream == vocabulary.index["<num>"]).any()  # "1990" became <num>
    assert stream.max() < vocabulary.first_key_symbol


@pytest.mark.parametrize("key_digits", [5, 1])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0, None])
def test_passkey_plants_the_key_at_its_depth_and_asks_at_the_end(streams, depth, key_digits):
    stream, _ = streams
    length = 300
    ids, digits = passkey_batch(stream, torch.Generator().manual_seed(0), 8, length, depth, key_digits)
    assert ids.shape == (8, length) and digits.shape == (8, key_digits)
    for row, key in zip(ids, digits):
        starts = (row == KEY).nonzero().flatten()
        assert len(starts) == 1 and (row == QUESTION).nonzero().flatten().tolist() == [length - key_digits - 1]
        start = int(starts[0])
        assert torch.equal(row[start + 1 : start + 1 + key_digits], key)
        assert torch.equal(row[-key_digits:], key)
        if depth is not None:
            assert start == round(depth * (length - 2 * (key_digits + 1) - 1))


@needs_data
def test_key_curriculum_grows_one_digit_every_n_steps():
    args = bench.parse_args(["--data_dir", str(DATA), "--key_digits", "3", "--key_curriculum_steps", "100"])
    assert [bench.training_key_digits(step, args) for step in (1, 100, 101, 200, 201, 1000)] == [1, 1, 2, 2, 3, 3]
    args = bench.parse_args(["--data_dir", str(DATA), "--key_digits", "3", "--key_curriculum_steps", "0"])
    assert {bench.training_key_digits(step, args) for step in (1, 500)} == {3}


@needs_data
@pytest.mark.parametrize("steps", ["-1", "500"])
def test_key_curriculum_must_leave_room_for_the_whole_key(steps, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--data_dir", str(DATA), "--key_curriculum_steps", steps, "--passkey_steps", "2000"])
    assert "--key_curriculum_steps" in capsys.readouterr().err


@needs_data
@pytest.mark.parametrize("device", ["gpu", "cuda"])
def test_device_must_exist_here(device, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit):
        bench.parse_args(["--data_dir", str(DATA), "--device", device])
    assert f"--device {device}" in capsys.readouterr().err.replace("'", "")


@needs_data
def test_short_training_examples_come_first():
    arguments = ["--data_dir", str(DATA), "--train_length", "1024", "--short_train_length", "256"]
    args = bench.parse_args(arguments + ["--short_train_steps", "300"])
    assert [bench.training_length(step, args) for step in (1, 300, 301, 1000)] == [256, 256, 1024, 1024]
    args = bench.parse_args(arguments)
    assert bench.training_length(1, args) == 1024


@needs_data
@pytest.mark.parametrize("steps", ["-1", "1000"])
def test_short_training_must_leave_steps_at_the_training_length(steps, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--data_dir", str(DATA), "--passkey_steps", "1000", "--short_train_steps", steps])
    assert "--short_train_steps" in capsys.readouterr().err


@needs_data
def test_learning_rate_warms_up_holds_then_decays_to_zero():
    args = bench.parse_args(["--warmup_steps", "4", "--decay_steps", "10", "--key_curriculum_steps", "0"])
    factors = [bench.learning_rate_factor(done, 100, args) for done in range(100)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and set(factors[4:90]) == {1.0}
    assert factors[90:] == pytest.approx([k / 10 for k in range(10, 0, -1)])  # the last step's is 0.1, not 0
    assert {bench.learning_rate_factor(d, 100, bench.parse_args([])) for d in range(100, 200)} == {1.0}  # no decay
    with pytest.raises(SystemExit):
        bench.parse_args(["--decay_steps", "200", "--passkey_steps", "300", "--mqar_steps", "100"])


@needs_data
def test_mqar_curriculum_adds_one_pair_every_n_steps():
    arguments = ["--data_dir", str(DATA), "--mqar_pairs", "2", "4", "--mqar_steps", "1000"]
    generator = torch.Generator().manual_seed(0)
    args = bench.parse_args(arguments + ["--mqar_curriculum_steps", "100"])
    steps = (1, 100, 101, 201, 301, 1000)
    assert [bench.training_mqar_pairs(step, args, generator) for step in steps] == [1, 1, 2, 3, 4, 4]
    args = bench.parse_args(arguments)  # no curriculum: every batch draws one of --mqar_pairs
    assert {bench.training_mqar_pairs(step, args, generator) for step in range(1, 50)} == {2, 4}


@needs_data
@pytest.mark.parametrize("steps", ["-1", "400"])
def test_mqar_curriculum_must_leave_room_for_the_most_pairs(steps, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(
            ["--data_dir", str(DATA), "--mqar_pairs", "4", "8", "--mqar_steps", "2800"]
            + ["--mqar_curriculum_steps", steps]
        )
    assert "--mqar_curriculum_steps" in capsys.readouterr().err


@needs_data
def test_mqar_lengths_must_hold_the_pairs_and_the_queries(streams, capsys):
    arguments = ["--data_dir", str(DATA), "--mqar_spacing", "64", "--mqar_pairs", "2", "4", "--mqar_lengths"]
    bench.parse_args(arguments + ["202"])  # pair 4 opens at 192 and ends at 194; 8 query tokens follow
    with pytest.raises(SystemExit):
        bench.parse_args(arguments + ["201"])
    assert "202 tokens" in capsys.readouterr().err
    stream, vocabulary = streams
    ids, answers = mqar_batch(stream, torch.Generator().manual_seed(0), vocabulary, 4, 202, 4, 64)
    for row, expected in zip(ids, answers):  # at the shortest length, no query overwrote a pair
        pairs = dict(zip(row[0:193:64].tolist(), row[1:194:64].tolist()))
        assert [pairs[key] for key in row[-8::2].tolist()] == expected.tolist()


@pytest.mark.parametrize("spacing", [2, 16])
def test_mqar_asks_every_key_once_for_its_value(streams, spacing):
    stream, vocabulary = streams
    ids, answers = mqar_batch(stream, torch.Generator().manual_seed(0), vocabulary, 4, 160, 8, spacing)
    is_key = (ids >= vocabulary.first_key_symbol) & (ids < vocabulary.first_value_symbol)
    assert is_key[:, : 8 * spacing].nonzero()[:, 1].view(4, 8).eq(torch.arange(8) * spacing).all()  # where pairs open
    for row, expected in zip(ids, answers):
        pairs = dict(zip(row[0 : 8 * spacing : spacing].tolist(), row[1 : 8 * spacing : spacing].tolist()))
        asked = row[-16::2].tolist()
        assert sorted(asked) == sorted(pairs) and len(set(asked)) == 8
        assert row[-15::2].tolist() == [pairs[key] for key in asked] == expected.tolist()


def test_answer_logits_predict_the_answer_tokens():
    """Logits at position t predict token t + 1: the kept positions are those right before each answer."""
    positions = []

    class Recorder(torch.nn.Module):
        def forward(self, ids, logits_to_keep):
            positions.append(logits_to_keep)
            return type("Output", (), {"logits": ids[:, -logits_to_keep:, None].float()})()

    ids = torch.arange(20)[None]
    assert answer_logits(Recorder(), ids, 5, None)[0, :, 0].tolist() == [14, 15, 16, 17, 18]
    assert answer_logits(Recorder(), ids, 3, None, stride=2)[0, :, 0].tolist() == [14, 16, 18]
    assert answer_logits(Recorder(), ids, 2, 6)[0, :, 0].tolist() == [17, 18]  # a 6-token context sees the end


def assert_plot_shows(saved_figure, output):
    """The PNG written is the figure, and the figure draws the results saved beside it: per model, passkey exact
    match (mean over depths) by length, for each way it was evaluated, and MQAR accuracy at the most pairs."""
    path, figure, dpi = saved_figure
    assert path == output.with_suffix(".png")
    assert_png_of(path, figure, dpi)
    saved = json.loads(output.with_suffix(".json").read_text())
    expected = {"passkey": {}, "mqar": {}}
    for result in saved["results"]:
        for label, rows in bench.passkey_runs(result):
            if rows:
                lengths = sorted({row["length"] for row in rows})
                by_length = [[row["accuracy"] for row in rows if row["length"] == n] for n in lengths]
                expected["passkey"][label] = (lengths, [sum(a) / len(a) for a in by_length])
        most = [row for row in result["mqar"] if row["pairs"] == max(saved["settings"]["mqar_pairs"])]
        if most:
            expected["mqar"][result["model"]] = ([row["length"] for row in most], [row["accuracy"] for row in most])
    panels = {axis.get_title().split(",")[0].lower(): axis for axis in figure.axes}
    assert panels.keys() == {task for task, lines in expected.items() if lines}
    for task, axis in panels.items():
        drawn = {
            line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for line in axis.get_lines()
            if line.get_label() != "training length"
        }
        assert drawn.keys() == expected[task].keys(), task
        for label, (lengths, accuracy) in expected[task].items():
            assert drawn[label][0] == lengths and drawn[label][1] == pytest.approx(accuracy), (task, label)


def assert_whole_answers(row: dict, answers: int) -> None:
    """An accuracy is the share of `answers` that were right: a whole number of them (to the 4 decimals written), and
    a passkey's at most its weakest digit's (all digits right, or the answer is wrong)."""
    right = row["accuracy"] * answers
    assert right == pytest.approx(round(right), abs=1e-3) and 0 <= round(right) <= answers, (row, answers)
    if "digit_accuracy" in row:
        assert row["accuracy"] <= min(row["digit_accuracy"]) + 1e-4, row


@needs_data
def test_tiny_run_writes_table_and_plot(tmp_path, monkeypatch):
    figures = record_saved_figures(monkeypatch)
    output = tmp_path / "long_context"
    arguments = [
        "--data_dir", str(DATA), "--jobs", "1", "--passkey_steps", "2", "--train_length", "128", "--eval_lengths",
        "128", "256", "--eval_examples", "2", "--mqar_train_length", "64", "--mqar_lengths", "64", "128",
        "--mqar_pairs", "2", "4", "--hidden_size", "16", "--num_heads", "2", "--window_size", "16", "--depths", "0.5",
        "--memory_review_cells", "4", "--memory_salient_cells", "2", "--key_digits", "2", "--key_curriculum_steps",
        "1", "--short_train_length", "64", "--short_train_steps", "1", "--decay_steps", "1",
    ]  # fmt: skip
    models = tmp_path / "models"
    results = bench.main(arguments + ["--output", str(output), "--mqar_steps", "2", "--save_models", str(models)])
    assert [r["model"] for r in results] == bench.DEFAULT_MODELS
    saved = json.loads(output.with_suffix(".json").read_text())
    check_result(saved)
    assert saved["settings"]["key_digits"] == 2 and saved["device"] == "cpu"
    for result in saved["results"]:
        assert {row["length"] for row in result["passkey"]} == {128, 256}
        assert len(result["mqar"]) == 4
        for row in result["mqar"]:  # 2 examples of 2 or 4 pairs
            assert_whole_answers(row, 2 * row["pairs"])
        for row in result["passkey"]:  # 2 examples
            assert_whole_answers(row, 2)
        decoded = [row for row in result["passkey"] if "ms_per_token" in row]
        assert len(decoded) == (0 if result["model"] == "gpt2" else 2)
        if (
            result["model"] != "gpt2"
        ):  # also evaluated with memory review bounded to 4 cells: at 256 tokens, 16 windows
            bounded = [row for row in result["passkey_bounded"] if "cache_bytes" in row]
            assert [row["length"] for row in bounded] == [128, 256]
            assert bounded[0]["cache_bytes"] == bounded[1]["cache_bytes"] < decoded[1]["cache_bytes"]
        # ... and keeping its 2 most salient older cells (the official layer has no salience)
        if result["model"] in ("ran", "ran-associative"):
            salient = [row for row in result["passkey_salient"] if "cache_bytes" in row]
            assert salient[0]["cache_bytes"] == salient[1]["cache_bytes"] > bounded[1]["cache_bytes"]
        else:
            assert "passkey_salient" not in result
    # Each trained passkey model is saved, and saved as trained: not with the bound it was evaluated with last.
    assert sorted(path.name for path in (tmp_path / "models").iterdir()) == sorted(
        f"{m}-passkey" for m in bench.DEFAULT_MODELS
    )
    reloaded = AutoConfig.from_pretrained(tmp_path / "models" / "ran-passkey")
    assert reloaded.model_type == "ran" and reloaded.memory_review_cells is reloaded.memory_salient_cells is None
    for row in saved["results"][0]["passkey"]:  # exact match is every digit right: never above the worst digit
        assert len(row["digit_accuracy"]) == 2 and row["accuracy"] <= min(row["digit_accuracy"])
    table = output.with_suffix(".md").read_text()
    assert "| ran |" in table and "| ran, last 4 cells |" in table and "| ran, last 4 + 2 salient cells |" in table
    assert "| ran, last 4 cells | 50% |" in table  # exact match per depth, beside the mean over depths
    assert "Accuracy of each digit" in table and "2 steps at 128 tokens, the first 1 at 64" in table
    assert len(figures) == 1
    assert_plot_shows(figures[0], output)

    # Read back instead of trained, the saved models answer the same examples the same way.
    reread = bench.main(
        arguments + ["--output", str(tmp_path / "reread"), "--mqar_steps", "0", "--load_models", str(models)]
    )
    assert [r["model"] for r in reread] == bench.DEFAULT_MODELS

    def answers(result):
        runs = ("passkey", "passkey_bounded", "passkey_salient")
        keep = ("length", "depth", "accuracy", "digit_accuracy", "cache_bytes")
        return {run: [{k: row.get(k) for k in keep} for row in result[run]] for run in runs if run in result}

    for trained, loaded in zip(results, reread):
        assert answers(loaded) == answers(trained) and loaded["passkey_train_seconds"] == 0.0
    assert "(the models saved in" in (tmp_path / "reread.md").read_text()


@needs_data
def test_mqar_steps_0_runs_the_passkey_only_and_later_runs_merge_or_say_why_not(tmp_path, capsys, monkeypatch):
    figures = record_saved_figures(monkeypatch)
    output = tmp_path / "passkey_only"

    def run(models, passkey_steps="2"):
        return bench.main(
            [
                "--data_dir", str(DATA), "--output", str(output), "--models", *models, "--passkey_steps",
                passkey_steps, "--mqar_steps", "0", "--train_length", "128", "--eval_lengths", "128",
                "--key_digits", "1", "--eval_examples", "2", "--hidden_size", "16", "--num_heads", "2",
                "--window_size", "16", "--depths", "0.5", "--jobs", "1",
            ]
        )  # fmt: skip

    results = run(["ran"])
    assert results[0]["mqar"] == [] and len(results[0]["passkey"]) == 1
    table = output.with_suffix(".md").read_text()
    assert "MQAR: not run" in table and "| pairs |" not in table
    assert_plot_shows(figures[-1], output)
    assert [r["model"] for r in run(["gpt2"])] == ["ran", "gpt2"]  # same arguments: merged
    assert_plot_shows(figures[-1], output)  # both models drawn
    assert [r["model"] for r in run(["gpt2"], passkey_steps="3")] == ["gpt2"]  # other arguments: replaced...
    assert "run with other passkey_steps" in capsys.readouterr().out  # ... and the user is told


@needs_data
def test_passkey_steps_0_runs_mqar_only_with_pairs_one_per_window(tmp_path, monkeypatch):
    figures = record_saved_figures(monkeypatch)
    output = tmp_path / "mqar_only"
    results = bench.main(
        [
            "--data_dir", str(DATA), "--output", str(output), "--models", "ran", "gpt2", "--passkey_steps", "0",
            "--mqar_steps", "2", "--mqar_train_length", "64", "--mqar_lengths", "64", "128", "--mqar_pairs", "2",
            "--mqar_spacing", "16", "--eval_examples", "2", "--hidden_size", "16", "--num_heads", "2",
            "--window_size", "16", "--jobs", "1",
        ]
    )  # fmt: skip
    assert [(r["passkey"], len(r["mqar"])) for r in results] == [([], 2), ([], 2)]
    table = output.with_suffix(".md").read_text()
    assert "Passkey: not run" in table and "opening every 16 tokens" in table and "| ran | 2 |" in table
    assert len(figures) == 1
    assert_plot_shows(figures[0], output)


@needs_data
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_tiny_run_on_cuda(tmp_path):
    results = bench.main(
        [
            "--data_dir", str(DATA), "--output", str(tmp_path / "cuda"), "--models", "ran", "gpt2", "--device",
            "cuda", "--passkey_steps", "2", "--mqar_steps", "2", "--train_length", "128", "--eval_lengths", "128",
            "256", "--key_digits", "2", "--eval_examples", "2", "--mqar_train_length", "64", "--mqar_lengths", "64",
            "--mqar_pairs", "2", "--hidden_size", "16", "--num_heads", "2", "--window_size", "16", "--depths", "0.5",
            "--jobs", "1",
        ]
    )  # fmt: skip
    for result in results:
        assert len(result["passkey"]) == 2 and len(result["mqar"]) == 1
        for row in result["passkey"] + result["mqar"]:  # 2 examples (of 2 pairs)
            assert_whole_answers(row, 2 * row.get("pairs", 1))
    assert [row["cache_bytes"] > 0 for row in results[0]["passkey"]] == [True, True]  # the RAN decoded on CUDA


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--mqar_steps", "-1"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--depths", "1.5"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--mqar_pairs", "100"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--memory_review_cells", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--memory_salient_cells", "2"])  # salient cells beyond a bound that is not set
    with pytest.raises(SystemExit):
        bench.parse_args(["--passkey_steps", "0", "--mqar_steps", "0"])  # nothing to run
    with pytest.raises(SystemExit):
        bench.parse_args(["--mqar_spacing", "1"])
    with pytest.raises(SystemExit):  # no saved model there
        bench.parse_args(["--load_models", str(Path(__file__).parent), "--mqar_steps", "0"])


@needs_data
def test_training_that_turns_nan_stops_and_says_when():
    class Diverging(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, ids):
            return torch.zeros(ids.shape[0], 1, 10) * self.scale / (self.scale - 1)  # 0 / 0: NaN

    args = bench.parse_args(["--jobs", "1", "--data_dir", str(DATA)])
    batch = lambda step: (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long))  # noqa: E731
    model = Diverging()
    result = bench.train(model, batch, lambda m, ids, count: m(ids), 5, args, "nan")
    assert result == {"losses": [], "diverged_at": 1} and model.scale.item() == 1.0  # no step taken with NaN


@needs_data
def test_the_mqar_anchors_run_when_named_and_gla_refuses_saving(tmp_path, capsys):
    """Llama and the gated linear attention train and are scored on MQAR; the GLA, not a Transformers model, is
    refused with --save_models before anything runs."""
    arguments = [
        "--data_dir", str(DATA), "--jobs", "1", "--passkey_steps", "0", "--mqar_steps", "2", "--mqar_train_length",
        "64", "--mqar_lengths", "64", "--mqar_pairs", "2", "--eval_examples", "2", "--hidden_size", "16",
        "--num_heads", "2", "--window_size", "16", "--models", "llama", "gla",
    ]  # fmt: skip
    results = bench.main(arguments + ["--output", str(tmp_path / "anchors")])
    assert [r["model"] for r in results] == ["llama", "gla"]
    for row in [row for result in results for row in result["mqar"]]:  # 2 examples of 2 pairs
        assert_whole_answers(row, 4)
    with_passkey = arguments[:5] + ["1"] + arguments[6:] + ["--key_curriculum_steps", "0"]  # --passkey_steps 1
    with pytest.raises(SystemExit):
        bench.parse_args(with_passkey + ["--save_models", str(tmp_path / "models")])
    assert "gla is not a Transformers model" in capsys.readouterr().err
