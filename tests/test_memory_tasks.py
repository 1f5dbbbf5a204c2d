"""The memory benchmarks' generators (scripts/benchmarks/memory_tasks.py): every answer is right by construction
(checked by replaying the facts read back from the tokens), sequences have the length asked for, facts are spread over
all of it, and the same seed gives the same examples."""

import pytest
import torch
from memory_tasks import (
    BEFORE,
    DEFAULT_STATE_SETTINGS,
    DROP,
    FIRST_FILLER,
    FIRST_NAME,
    FIRST_OBJECT,
    FIRST_PLACE,
    GET,
    MOVE,
    QUESTION_TOKENS,
    WHERE,
    WHERE_OBJECT,
    StateTrackingSettings,
    mqar_answer_batch,
    state_tracking_batch,
)


def replay(row: list[int], story_end: int):
    """Read the facts back from the tokens and replay them: each name's place, each object's place and the places
    it has been, in order."""
    person_at, holding, object_at, history = {}, {}, {}, {}
    facts, i = [], 0
    while i < story_end:  # a fact is three tokens that are not filler; facts may touch
        if row[i] < FIRST_FILLER:
            facts.append((i, row[i : i + 3]))
            i += 3
        else:
            i += 1
    for _, (subject, verb, thing) in facts:
        assert FIRST_NAME <= subject < FIRST_OBJECT, "a fact starts with a name"
        if verb == MOVE:
            person_at[subject] = thing
            if subject in holding:
                object_at[holding[subject]] = thing
                if history[holding[subject]][-1] != thing:
                    history[holding[subject]].append(thing)
        elif verb == GET:
            assert subject not in holding and subject in person_at, "a person holds one object, and is somewhere"
            assert object_at.get(thing, person_at[subject]) == person_at[subject], "picked up where it lies"
            holding[subject], object_at[thing] = thing, person_at[subject]
            history.setdefault(thing, [person_at[subject]])
        else:
            assert verb == DROP and holding.pop(subject) == thing
    return facts, person_at, object_at, history


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3"])
@pytest.mark.parametrize("length", [512, 2048])
def test_every_answer_follows_from_the_facts(task, length):
    settings = DEFAULT_STATE_SETTINGS[task]
    ids, positions, answers = state_tracking_batch(settings, seed=3, batch_size=16, length=length)
    assert ids.shape == (16, length) and positions.shape == (settings.questions,)
    assert positions[-1] == length - 1 and (ids[:, positions] == answers).all()
    assert ((answers >= FIRST_PLACE) & (answers < FIRST_PLACE + settings.places)).all()
    story_end = length - settings.questions * QUESTION_TOKENS[task]
    for row, row_answers in zip(ids.tolist(), answers.tolist()):
        facts, person_at, object_at, history = replay(row, story_end)
        assert len(facts) == settings.facts
        stretch = story_end // settings.facts  # fact i lies within the i-th stretch of filler
        assert all(i * stretch <= start <= (i + 1) * stretch - 3 for i, (start, _) in enumerate(facts))
        asked = []
        for q, answer in enumerate(row_answers):
            question = row[positions[q] - QUESTION_TOKENS[task] + 1 : positions[q]]
            asked.append(question[1])
            if task == "qa1":
                assert question[0] == WHERE and person_at[question[1]] == answer
            elif task == "qa2":
                assert question[0] == WHERE_OBJECT and object_at[question[1]] == answer
            else:
                places = history[question[1]]
                last_arrival = len(places) - 1 - places[::-1].index(question[2])
                assert question[0] == BEFORE and last_arrival >= 1 and places[last_arrival - 1] == answer
        assert len(set(asked)) == len(asked), "each question is about a different name or object"


def test_same_seed_same_examples_and_lengths_checked():
    settings = DEFAULT_STATE_SETTINGS["qa3"]
    first = state_tracking_batch(settings, seed=7, batch_size=4, length=300)
    again = state_tracking_batch(settings, seed=7, batch_size=4, length=300)
    other = state_tracking_batch(settings, seed=8, batch_size=4, length=300)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])
    with pytest.raises(ValueError, match="at least"):
        state_tracking_batch(settings, seed=0, batch_size=1, length=settings.shortest() - 1)
    with pytest.raises(ValueError, match="no state-tracking task"):
        StateTrackingSettings("qa4")


def test_mqar_answers_are_the_values_of_the_keys_asked():
    ids, positions, answers = mqar_answer_batch(seed=0, batch_size=4, length=1024, pairs=16)
    assert ids.shape == (4, 1024) and (ids[:, positions] == answers).all()
    for row in range(4):
        for position, answer in zip(positions.tolist(), answers[row].tolist()):
            stored = (ids[row, :32] == ids[row, position - 1]).nonzero().item()  # the pairs open the sequence
            assert ids[row, stored + 1] == answer
    assert torch.equal(ids, mqar_answer_batch(seed=0, batch_size=4, length=1024, pairs=16)[0])


def test_the_models_compared_have_the_default_causal_rans_parameter_count():
    from argparse import Namespace

    from benchmark_memory_tasks import build, size

    args = Namespace(hidden_size=64, num_layers=2, num_heads=4, ran_config={})
    ran = size(build("ran", 103, args, context=64))
    for name in ("llama", "mamba2"):
        assert abs(size(build(name, 103, args, context=64)) - ran) <= 0.05 * ran, name


def test_ran_config_sets_fields_on_the_ran_only_and_refuses_unknown_ones(capsys):
    """`--ran_config` sets RANConfig fields on the RAN built (the baselines keep the default RAN's size), and a name
    that is no RANConfig field, a field the benchmark sets itself or a value out of range stops the call first."""
    from benchmark_memory_tasks import build, describe, parse_args, size

    argv = ["--task", "mqar", "--grid", "64x4"]
    no_dropout = '{"hidden_dropout_prob": 0, "attention_probs_dropout_prob": 0}'
    args = parse_args([*argv, "--ran_config", no_dropout])
    assert args.ran_config == {"hidden_dropout_prob": 0, "attention_probs_dropout_prob": 0}
    ran = build("ran", 193, args, context=64)
    assert ran.config.hidden_dropout_prob == 0 and ran.config.attention_probs_dropout_prob == 0
    assert describe(ran, args.ran_config)["attention_probs_dropout_prob"] == 0
    assert size(build("llama", 193, args, context=64)) == size(build("llama", 193, parse_args(argv), context=64))
    assert parse_args(argv).ran_config == {} and build("ran", 193, parse_args(argv), 64).config.hidden_dropout_prob > 0
    for wrong, message in [
        ('{"hiden_dropout_prob": 0}', "hiden_dropout_prob is not a RANConfig field"),
        ('{"hidden_size": 32}', "hidden_size set by the benchmark itself"),
        ('{"hidden_dropout_prob": -1}', "hidden_dropout_prob"),
        ("[0]", "must be a JSON object"),
    ]:
        with pytest.raises(SystemExit):
            parse_args([*argv, "--ran_config", wrong])
        assert message in capsys.readouterr().err, wrong


@pytest.mark.slow  # a training loop, if a tiny one (3 s)
def test_a_two_step_sweep_writes_its_result_files_and_resumes(tmp_path):
    """The runner end to end at a toy size (2 steps, 64 tokens): a result file in the one format, each run with the
    command that trained it, the best rate read at 4x; called again, it trains nothing."""
    import json

    from benchmark_memory_tasks import main
    from benchmark_utils import check_result

    argv = ["--task", "mqar", "--grid", "64x4", "--models", "llama", "--learning_rates", "1e-3", "1e-2", "--steps",
            "2", "--batch_size", "2", "--eval_examples", "2", "--validation_examples", "2", "--log_every", "1",
            "--output", str(tmp_path / "mqar"), "--checkpoints", str(tmp_path / "weights")]  # fmt: skip
    record = main(argv)
    check_result(record)
    runs = record["results"]["runs"]
    assert [r["learning_rate"] for r in runs] == [1e-3, 1e-2] and all("command" in r for r in runs)
    (best,) = record["results"]["summary"]
    assert set(best["accuracy_mean"]) == {"64", "256"}
    assert (tmp_path / "mqar.md").exists() and (tmp_path / "mqar.png").exists()
    assert main(argv)["results"]["runs"] == json.loads((tmp_path / "mqar.json").read_text())["results"]["runs"]


def test_runs_with_other_ran_config_fields_are_not_taken_for_earlier_ones(tmp_path):
    """A result file's runs are kept only by a call with the same `--ran_config`; a file written before the option
    existed ran the default RAN."""
    import json

    from benchmark_memory_tasks import earlier_runs, parse_args

    argv = ["--task", "mqar", "--grid", "64x4", "--output", str(tmp_path / "mqar")]
    settings = {**vars(parse_args(argv)), "grid": [[64, 4]]}
    for written in ({}, None):  # None: a file without the field
        (tmp_path / "mqar.json").write_text(json.dumps({"settings": {**settings, "ran_config": written},
                                                        "results": {"runs": [{"model": "ran"}]}}))  # fmt: skip
        assert earlier_runs(parse_args(argv)) == [{"model": "ran"}]
        assert earlier_runs(parse_args([*argv, "--ran_config", '{"hidden_dropout_prob": 0}'])) == []


def test_a_length_curriculum_grows_from_its_start_to_the_training_length_in_half_the_steps(tmp_path):
    """`--length_curriculum 128`: the first step trains at 128 tokens, lengths never shrink, are multiples of 8 and
    reach the training length at half the steps; without it, every step trains at the training length. A file written
    with another curriculum (or before the option existed) is not taken for this one's."""
    import json

    from benchmark_memory_tasks import curriculum_length, earlier_runs, parse_args

    args = parse_args(["--task", "qa1", "--steps", "100", "--length_curriculum", "128"])
    lengths = [curriculum_length(step, 512, args, shortest=60) for step in range(100)]
    assert lengths[0] == 128 and lengths[50:] == [512] * 50 and lengths == sorted(lengths)
    assert all(length % 8 == 0 for length in lengths) and len(set(lengths)) > 10
    plain = parse_args(["--task", "qa1", "--steps", "100"])
    assert {curriculum_length(step, 512, plain, shortest=60) for step in range(100)} == {512}
    assert curriculum_length(0, 512, parse_args(["--length_curriculum", "8"]), shortest=60) == 60

    argv = ["--task", "qa1", "--output", str(tmp_path / "qa1")]
    settings = vars(parse_args(argv)) | {"grid": [list(g) for g in plain.grid]}
    (tmp_path / "qa1.json").write_text(json.dumps({"settings": settings | {"length_curriculum": None},
                                                   "results": {"runs": [{"model": "ran"}]}}))  # fmt: skip
    assert earlier_runs(parse_args(argv)) == [{"model": "ran"}]
    assert earlier_runs(parse_args([*argv, "--length_curriculum", "128"])) == []


def test_a_trained_ran_is_read_again_at_other_window_sizes(tmp_path):
    """`read_at_window_sizes.py` end to end at a toy size: it finds the RAN's weights of a result file, reads them at
    each window size on the benchmark's test and validation examples (at the trained window, the benchmark's own
    figures), names the window validation chooses, and writes its result files in the one format; a file whose weights are gone is refused, naming the folder."""
    from benchmark_memory_tasks import main as train
    from benchmark_utils import check_result
    from read_at_window_sizes import main as read_again

    weights = tmp_path / "weights"
    trained = train(["--task", "mqar", "--grid", "64x4", "--models", "ran", "--learning_rates", "1e-3", "--steps", "2",
           "--batch_size", "2", "--eval_examples", "4", "--validation_examples", "2", "--log_every", "1",
           "--ran_config", '{"window_size": 32, "min_window_size": 4}', "--output", str(tmp_path / "mqar"),
           "--checkpoints", str(weights)])  # fmt: skip
    argv = ["--results", str(tmp_path / "mqar.json"), "--checkpoints", str(weights), "--window_sizes", "16", "32",
            "--lengths", "64", "256"]  # fmt: skip
    record = read_again(argv)
    check_result(record)
    (run,), (source_run,) = record["results"]["runs"], trained["results"]["runs"]
    assert set(run["accuracy_by_window"]) == {"16", "32"}
    assert run["accuracy_by_window"]["32"] == run["accuracy"]  # the benchmark read at 32, on the same examples
    validation = run["validation_by_window"]
    assert validation["32"] == source_run["validation_accuracy"]  # and validated at 32 on the same examples
    assert validation[run["chosen_window"]] == max(validation.values())
    assert (tmp_path / "mqar_windows.md").exists() and (tmp_path / "mqar_windows.png").exists()
    with pytest.raises(SystemExit, match="no RAN weights"):
        read_again([*argv[:2], "--checkpoints", str(tmp_path / "elsewhere"), *argv[4:]])
