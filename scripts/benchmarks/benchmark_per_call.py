#!/usr/bin/env python
"""What a call costs besides the arithmetic: the causal RAN beside Llama and Mamba-2 of the same width, in one run.

    python scripts/benchmarks/benchmark_per_call.py                                  # width 128, 2 layers
    python scripts/benchmarks/benchmark_per_call.py --hidden_size 512 --num_layers 4 --num_heads 8 \
        --output benchmarks/per_call/per_call_512.json

Per model: Python calls (`sys.setprofile`) of one decoding step inside greedy `generate()` (the difference between
`--steps` + 2 and 2 new tokens, per step), and of one sequence-classifier forward at `--classifier_length` tokens
(RAN and Llama); "ran" is the default causal RAN (its associative memory on), "ran-no-memory" (asked for by
`--models`) the same without the memory, as "ran" was before it; then milliseconds per new token after prompts of
`--contexts` tokens, RAN also with its decoding
steps compiled by `generate()` ("ran-compiled": Transformers' compile path, inductor, asked for on a CPU with
`CompileConfig._compile_all_devices`; the others eager): every model reads the prompt
for real (RAN in chunks of `--prefill_chunk` through its cache, Mamba-2 in one pass, Llama in one pass up to
`--llama_max_context`, beyond which it is left out), then `generate()` adds `--steps` tokens greedily, timed from the
first step's logits to the last's by a logits processor (so the prompt's pass is not counted): the median step of each
of `--repeats` rounds, which time every model and context in turn, the least of them reported (on a shared machine
noise only adds time). Of an eager step, the model's forward is timed too (a forward pre-hook to the step's logits,
"ms_forward_at_N"): the rest is `generate()`'s own, which grows with the context for every model (it adds each new
token to ids that hold the whole prompt). One thread by default.
With `--memory_review_cells N` the RAN reviews the last N cells only, so that a step's work no longer grows with
the context (by default it reviews one cell per window read so far). Writes a table to stdout and one JSON in the
benchmarks' result format.
"""

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from benchmark_utils import POSITIVE, command_line, machine_info, machine_line, result_record, write_result
from causal_baselines import llama_inner_size
from tqdm.auto import tqdm
from transformers import (
    CompileConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LogitsProcessor,
    LogitsProcessorList,
    Mamba2Config,
    Mamba2ForCausalLM,
)

from ran_hf import RANCache, RANConfig, RANForCausalLM, RANForSequenceClassification


MODELS = ("ran", "ran-compiled", "llama", "mamba2")
OPTIONAL_MODELS = ("ran-no-memory",)  # the causal RAN without its associative memory: only where asked for


class StepClock(LogitsProcessor):
    """Records the time at every step of `generate()` (called once per new token, after its forward) and, as a
    forward pre-hook on the model (`forward_started`), when each forward starts."""

    def __init__(self):
        self.times, self.forward_starts = [], []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores

    def forward_started(self, module, args):
        self.forward_starts.append(time.perf_counter())


def python_calls(function) -> int:
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profile)
    try:
        function()
    finally:
        sys.setprofile(None)
    return calls


def build(name: str, args, classifier: bool = False):
    width, layers, heads, vocab = args.hidden_size, args.num_layers, args.num_heads, args.vocab_size
    if name.startswith("ran"):
        config = RANConfig(
            vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
            head_dim=width // heads, window_size=args.window_size, min_window_size=min(16, args.window_size // 4),
            is_causal=not classifier, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            memory_review_cells=None if classifier else args.memory_review_cells,  # (the encoder reviews all)
            associative_memory=False if name == "ran-no-memory" else None,  # (None: the design's)
        )  # fmt: skip
        return (RANForSequenceClassification if classifier else RANForCausalLM)(config).eval()
    if name == "llama":
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=llama_inner_size(width), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=args.llama_max_context + 64,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        return (LlamaForSequenceClassification if classifier else LlamaForCausalLM)(config).eval()
    config = Mamba2Config(
        vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_heads=2 * width // 64, head_dim=64,
        state_size=64, n_groups=1, expand=2, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return Mamba2ForCausalLM(config).eval()


def generate(model, ids, steps, **kwargs) -> StepClock:
    """A greedy `generate()` of `steps` tokens, clocked. The forwards are clocked only where `generate()` calls them
    eagerly: a compiled step would trace the hook."""
    clock = StepClock()
    hook = None if "compile_config" in kwargs else model.register_forward_pre_hook(clock.forward_started)
    try:
        model.generate(
            ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
            logits_processor=LogitsProcessorList([clock]), **kwargs,
        )  # fmt: skip
    finally:
        if hook is not None:
            hook.remove()
    return clock


@torch.no_grad()
def calls_per_step(model, args) -> float:
    ids = torch.randint(1, args.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))

    def run(steps):  # without the clock: only the model's and `generate`'s own calls
        return model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)

    run(3)
    return (python_calls(lambda: run(args.steps + 2)) - python_calls(lambda: run(2))) / args.steps


@torch.no_grad()
def classifier_calls(name: str, args) -> int:
    model = build(name, args, classifier=True)
    ids = torch.randint(1, args.vocab_size, (1, args.classifier_length), generator=torch.Generator().manual_seed(0))
    model(ids)
    return python_calls(lambda: model(ids))


@torch.no_grad()
def prepare_timing(name: str, model, context: int, args) -> dict | None:
    """What a timed `generate()` after `context` tokens takes (None where the model is left out): the prompt's ids,
    and for the RAN its cache after reading them (in chunks, as a long text is read) and the compile config."""
    if name == "llama" and context > args.llama_max_context:
        return None
    ids = torch.randint(1, args.vocab_size, (1, context), generator=torch.Generator().manual_seed(context))
    kwargs = {}
    if name.startswith("ran"):  # the prompt read through the cache in chunks, as a long text is; `generate` the last
        cache = RANCache(model.config)
        for start in range(0, context - 1, args.prefill_chunk):
            model(ids[:, start : min(start + args.prefill_chunk, context - 1)], past_key_values=cache, use_cache=True)
        kwargs["past_key_values"] = cache
    if name == "ran-compiled":  # Transformers' compile path, asked for on a CPU
        kwargs["compile_config"] = CompileConfig(fullgraph=True, dynamic=False, mode="default")
        kwargs["compile_config"]._compile_all_devices = True
    return {"model": model, "ids": ids, "kwargs": kwargs}


@torch.no_grad()
def median_step(timing: dict, args) -> tuple[float, float | None]:
    """One greedy `generate()` of `--steps` tokens from the prepared prompt (a copy of its cache): the median time
    between two steps' logits, and the median of the model's forward in a step (from its start to its logits; None
    where the step is compiled), in ms. What is left of a step is `generate()`'s own: choosing the token and adding
    it to the ids, which hold the whole prompt."""
    kwargs, cache = timing["kwargs"], timing["kwargs"].get("past_key_values")
    fresh = {} if cache is None else {"past_key_values": copy.deepcopy(cache)}
    clock = generate(timing["model"], timing["ids"], args.steps + 1, **{**kwargs, **fresh})
    times = clock.times
    step = 1000 * statistics.median(later - earlier for earlier, later in zip(times, times[1:]))
    if not clock.forward_starts:
        return step, None
    forward = statistics.median(end - start for start, end in zip(clock.forward_starts[1:], times[1:]))
    return step, 1000 * forward


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden_size", type=POSITIVE, default=128)
    parser.add_argument("--num_layers", type=POSITIVE, default=2)
    parser.add_argument("--num_heads", type=POSITIVE, default=4)
    parser.add_argument("--vocab_size", type=POSITIVE, default=1000)
    parser.add_argument("--window_size", type=POSITIVE, default=128)
    parser.add_argument(
        "--memory_review_cells", type=POSITIVE, default=None,
        help="RAN's memory review reads the last N cells only (default: all, one per window so far)",
    )  # fmt: skip
    parser.add_argument("--contexts", type=POSITIVE, nargs="+", default=[512, 4096])
    parser.add_argument("--steps", type=POSITIVE, default=32, help="new tokens timed per context")
    parser.add_argument("--repeats", type=POSITIVE, default=3, help="timed runs per context: the least median wins")
    parser.add_argument("--prefill_chunk", type=POSITIVE, default=4096)
    parser.add_argument("--llama_max_context", type=POSITIVE, default=32768)
    parser.add_argument("--classifier_length", type=POSITIVE, default=512)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS + OPTIONAL_MODELS)
    parser.add_argument("--threads", type=POSITIVE, default=1)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/per_call/per_call_128.json"))
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info("cpu")
    print(machine_line(info))
    results, timings = [], {}
    for name in tqdm(args.models, desc="models"):
        model = build(name, args)
        compiled = name == "ran-compiled"
        row = {"model": name, "python_calls_per_decoding_step": None if compiled else calls_per_step(model, args)}
        row["python_calls_classifier_forward"] = classifier_calls(name, args) if name in ("ran", "llama") else None
        if compiled:  # compiled once, before the timed contexts
            median_step(prepare_timing(name, model, 512, args), args)
        for context in args.contexts:
            timings[name, context] = prepare_timing(name, model, context, args)
        results.append(row)
    # Every model and context once per round, round after round: a shared machine's slow spells fall on all of them
    # alike. Each keeps the least of its rounds' medians (noise only adds time).
    medians = {key: [] for key, timing in timings.items() if timing is not None}
    for _ in tqdm(range(args.repeats), desc="rounds"):
        for key in medians:
            medians[key].append(median_step(timings[key], args))
    for row in results:
        for context in args.contexts:
            times = medians.get((row["model"], context))
            row[f"ms_per_token_at_{context}"] = min(step for step, _ in times) if times else None
        for context in args.contexts:  # the least median forward (of any round: noise only adds time)
            times = medians.get((row["model"], context))
            forwards = [forward for _, forward in times or () if forward is not None]
            row[f"ms_forward_at_{context}"] = min(forwards) if forwards else None
    columns = list(results[0])
    print(" | ".join(f"{column:>14}" for column in columns))
    for row in results:
        print(" | ".join(f"{row[c]:>14.2f}" if isinstance(row[c], float) else f"{row[c]!s:>14}" for c in columns))
    record = result_record(command_line(__file__, argv), vars(args), results, device="cpu", dtype="float32", info=info)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.output, json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
