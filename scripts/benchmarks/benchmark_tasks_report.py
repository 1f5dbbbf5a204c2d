"""Tables and plots of benchmark_tasks.py: mean and spread over seeds, per task and model."""

import json
from pathlib import Path

import numpy as np
from benchmark_utils import machine_line, result_path, result_record, write_result


# The metric each task is ranked by, and whether lower is better.
MAIN_METRIC = {
    "probe": ("accuracy", False),
    "hyperpartisan": ("accuracy", False),
    "20newsgroups": ("accuracy", False),
    "eurlex": ("micro_f1", False),
    "conll": ("f1", False),
    "lm": ("perplexity", True),
    "window_study": ("accuracy", False),
}
REAL_CLASSIFICATION = ("hyperpartisan", "20newsgroups", "eurlex")
ABLATIONS = ("ran-mean-pooling", "ran-no-cell-residual", "ran-no-memory-review", "ran-no-rotary")


def summarize(results: list[dict]) -> dict:
    """{task: {model: {"mean", "min", "max", "seeds", "values", ...}}} of each task's main metric."""
    summary = {}
    for result in results:
        metric, _ = MAIN_METRIC[result["task"]]
        entry = summary.setdefault(result["task"], {}).setdefault(
            result["model"], {"metric": metric, "values": [], "seeds": [], "seconds": [], "seconds_per_epoch": []}
        )
        entry["values"].append(result["metrics"][metric])
        entry["seeds"].append(result["seed"])
        entry["seconds"].append(result["train_seconds"])
        entry["seconds_per_epoch"].append(result["seconds_per_epoch"])
        entry["parameters_without_embeddings"] = result["parameters_without_embeddings"]
        entry["parameters"] = result["parameters"]
        if result["task"] == "lm":
            entry.setdefault("word_perplexity", []).append(result["metrics"]["word_perplexity"])
            if "stream_perplexity" in result["metrics"]:
                entry.setdefault("stream_perplexity", []).append(result["metrics"]["stream_perplexity"])
    for models in summary.values():
        for entry in models.values():
            values = np.array(entry["values"])
            entry.update(mean=float(values.mean()), min=float(values.min()), max=float(values.max()))
            entry["mean_seconds"] = float(np.mean(entry["seconds"]))
            entry["mean_seconds_per_epoch"] = float(np.mean(entry["seconds_per_epoch"]))
    return summary


def classification_average(summary: dict) -> dict[str, float]:
    """Mean over the real classification tasks, for models that ran on all of them."""
    tasks = [task for task in REAL_CLASSIFICATION if task in summary]
    if not tasks:
        return {}
    models = set.intersection(*(set(summary[task]) for task in tasks))
    return {model: float(np.mean([summary[task][model]["mean"] for task in tasks])) for model in models}


def paired_average(summary: dict, model: str, reference: str = "ran") -> tuple[float, float, list[str]]:
    """Mean of `model` and of `reference` over the real classification tasks both ran on."""
    tasks = [t for t in REAL_CLASSIFICATION if model in summary.get(t, {}) and reference in summary.get(t, {})]
    return (
        float(np.mean([summary[t][model]["mean"] for t in tasks])),
        float(np.mean([summary[t][reference]["mean"] for t in tasks])),
        tasks,
    )


def target_checks(summary: dict) -> list[str]:
    """The claims this benchmark tests, each with its measured figures and whether it held."""

    def verdict(held: bool) -> str:
        return "**holds**" if held else "**does not hold**"

    checks = []
    probe = summary.get("probe", {})
    if "ran" in probe:
        ran, others = probe["ran"], ", ".join(f"{m} {e['mean'] * 100:.1f}" for m, e in probe.items() if m != "ran")
        line = f"Probe: RAN >= 95% in every seed: {verdict(ran['min'] >= 0.95)} ({ran['min'] * 100:.1f}% worst seed)"
        if "bert-512" in probe:
            bert = probe["bert-512"]
            line += f"; BERT-512 near chance: {verdict(abs(bert['mean'] - 0.5) <= 0.06)} ({bert['mean'] * 100:.1f}%)"
        checks.append(line + f". Others: {others}.")
    average = classification_average(summary)
    if "ran" in average:
        ran = average["ran"]
        baselines = {m: v for m, v in average.items() if not m.startswith("ran")}
        if baselines:
            beaten = [m for m, v in baselines.items() if ran >= v]
            checks.append(
                f"Average over the real classification tasks, RAN {ran * 100:.1f} >= every from-scratch baseline: "
                f"{verdict(len(beaten) == len(baselines))} ("
                + ", ".join(f"{m} {v * 100:.1f}" for m, v in sorted(baselines.items(), key=lambda item: -item[1]))
                + ")."
            )
        if "ran-bpie" in average:
            checks.append(f"RAN with BPIE (window_overlap) on that average: {average['ran-bpie'] * 100:.1f}.")
    ablations = sorted({m for task in REAL_CLASSIFICATION for m in summary.get(task, {}) if m in ABLATIONS})
    if ablations:
        paired = {m: paired_average(summary, m) for m in ablations}
        held = all(ablated <= full for ablated, full, _ in paired.values())
        checks.append(
            f"Every ablation <= RAN, averaged over the real tasks it ran on: {verdict(held)} ("
            + "; ".join(
                f"{m} {ablated * 100:.1f} vs RAN {full * 100:.1f} on {', '.join(tasks)}"
                for m, (ablated, full, tasks) in paired.items()
            )
            + ")."
        )
    lm = summary.get("lm", {})
    if {"ran-causal", "ran-causal-official"} <= set(lm):
        ours, official = lm["ran-causal"], lm["ran-causal-official"]
        checks.append(
            f"Language modelling, ours below the official causal design: {verdict(ours['max'] < official['min'])} "
            f"(token perplexity {ours['mean']:.1f} vs {official['mean']:.1f}; worst of ours vs best of theirs)."
        )
    if {"ran-causal", "ran-causal-associative"} <= set(lm):
        plain, associative = lm["ran-causal"], lm["ran-causal-associative"]
        # No regression: the associative memory's perplexity within the plain model's seed spread, or below it.
        checks.append(
            f"Language modelling, the associative memory no worse than without it: "
            f"{verdict(associative['mean'] <= plain['max'])} (token perplexity {associative['mean']:.1f} vs "
            f"{plain['mean']:.1f}, the plain model's seeds up to {plain['max']:.1f})."
        )
    if "llama" in lm:
        # Issue 62's bar: a causal RAN's perplexity at most 0.85 of a same-size Llama's, at equal budget.
        llama = lm["llama"]
        for name in (name for name in ("ran-causal", "ran-causal-long-memory", "ran-causal-one-window") if name in lm):
            ratio = lm[name]["mean"] / llama["mean"]
            checks.append(
                f"Language modelling, {name} at most 0.85 of Llama's perplexity: {verdict(ratio <= 0.85)} "
                f"({lm[name]['mean']:.1f} vs {llama['mean']:.1f}: {ratio:.2f}; worst seed "
                f"{lm[name]['max'] / llama['min']:.2f} of Llama's best)."
            )
    return checks


def cell(entry: dict | None, scale: float = 100.0, digits: int = 1) -> str:
    if entry is None:
        return "–"
    mean, low, high = (entry[key] * scale for key in ("mean", "min", "max"))
    return f"{mean:.{digits}f} ± {(high - low) / 2:.{digits}f}"


def markdown(summary: dict, results: list[dict], args, info: dict, command: str) -> str:
    seeds = sorted({result["seed"] for result in results})
    minutes = sum(result["train_seconds"] for result in results) / 60
    # A resumed benchmark holds runs of several checkouts: each is named, not only the one that wrote the report.
    commits = sorted({result["machine"]["git_sha"] for result in results if "machine" in result})
    runs_from = f" (runs from commits {', '.join(commits)})" if len(commits) > 1 else ""
    lines = [
        "# Task benchmark (from scratch, matched size, equal budget)",
        "",
        f"Machine: {machine_line(info)}{runs_from}. Seeds: {', '.join(map(str, seeds))}; each cell is the mean ± "
        f"half the range over seeds. Training time summed over runs: {minutes:.0f} min.",
        "",
        f"Command: `{command}`",
        "",
        f"Every model: width {args.hidden_size}, {args.num_layers} layers where it has layers, the same batches "
        f"(batch {args.batch_size}, CoNLL {2 * args.batch_size}), AdamW lr {args.learning_rate} with 10% warm-up and "
        f"linear decay, gradient clipping 1.0, dropout {args.dropout} (probe: 0). Steps: classification "
        f"{args.steps('hyperpartisan')}, probe {args.steps('probe')}, CoNLL {args.steps('conll')}, LM "
        f"{args.steps('lm')}. Documents are read up to {args.max_length} tokens (probe {args.probe_length}); "
        f"bert-512 reads the first 512. RAN window {args.window_size} (CoNLL {args.ner_window_size}, LM "
        f"{args.lm_window_size}); ran-bpie overlap {args.window_overlap}; SRNN / BPIE-BiSRNN slices of "
        f"{args.slice_length}, enrichment {args.enrichment}; recurrent baselines' widths matched to RAN's "
        "parameter count without embeddings. A dash: not run (the ablations run on Hyperpartisan and 20 Newsgroups, "
        "the residual and memory-review ablations also on the probe; `ABLATION_TASKS` in the script).",
        "",
    ]
    classification = [task for task in ("probe", *REAL_CLASSIFICATION) if task in summary]
    if classification:
        average = classification_average(summary)
        header = ["model", "params (no emb.)"] + [f"{task} ({MAIN_METRIC[task][0]})" for task in classification]
        if average:
            header.append("average of " + ", ".join(task for task in REAL_CLASSIFICATION if task in summary))
        lines += ["## Classification (test, %)", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        models = list(dict.fromkeys(model for task in classification for model in summary[task]))
        for model in models:
            parameters = next(summary[task][model] for task in classification if model in summary[task])
            row = [model, f"{parameters['parameters_without_embeddings'] / 1e3:.0f}K"]
            row += [cell(summary[task].get(model)) for task in classification]
            if average:
                row.append(f"{average[model] * 100:.1f}" if model in average else "–")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        lines.append(
            "Training seconds per run (mean over seeds): "
            + "; ".join(
                f"{task}: "
                + ", ".join(f"{model} {entry['mean_seconds']:.0f}" for model, entry in summary[task].items())
                for task in classification
            )
            + "."
        )
        lines.append("")
    if "conll" in summary:
        lines += ["## CoNLL-2003 NER (test entity F1, %)", "", "| model | F1 | train s |", "|---|---|---|"]
        lines += [f"| {m} | {cell(e)} | {e['mean_seconds']:.0f} |" for m, e in summary["conll"].items()]
        lines.append("")
    if "lm" in summary:
        lines += [
            "## Language modelling (WikiText-2 test; trained on WikiText-2 valid)",
            "",
            "Token perplexity of independent 512-token blocks, and of the same tokens read as one stream with the "
            "recurrent cache carried from block to block (`-`: not measured in that run).",
            "",
            "| model | token perplexity, blocks | token perplexity, stream | word perplexity, blocks | train s |",
            "|---|---|---|---|---|",
        ]

        def spread(values) -> str:
            values = np.array(values)
            return f"{values.mean():.1f} ± {(values.max() - values.min()) / 2:.1f}"

        for model, entry in summary["lm"].items():
            stream = spread(entry["stream_perplexity"]) if entry.get("stream_perplexity") else "-"
            words = spread(entry["word_perplexity"])
            lines.append(f"| {model} | {cell(entry, 1.0)} | {stream} | {words} | {entry['mean_seconds']:.0f} |")
        lines.append("")
    if "window_study" in summary:
        lines += [
            "## Window size (Hyperpartisan, RAN)",
            "",
            "| window | accuracy % | training s / epoch |",
            "|---|---|---|",
        ]
        for model, entry in sorted(summary["window_study"].items(), key=lambda item: int(item[0].split("-w")[1])):
            lines.append(f"| {model.split('-w')[1]} | {cell(entry)} | {entry['mean_seconds_per_epoch']:.1f} |")
        lines.append("")
    lines += ["## The issue's targets, checked", ""] + [f"- {line}" for line in target_checks(summary)] + [""]
    lines += ["## Data", ""]
    lines += [f"- {task}: {about}" for task, about in sorted({(r["task"], r["about"]) for r in results})]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [task for task in ("probe", *REAL_CLASSIFICATION, "conll", "lm") if task in summary]
    study = "window_study" in summary
    count = len(panels) + int(study)
    if count == 0:
        return
    columns = min(3, count)
    rows = -(-count // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.8 * rows), squeeze=False)
    axes = axes.flatten()
    for axis, task in zip(axes, panels):
        models = list(summary[task])
        means = [summary[task][m]["mean"] for m in models]
        errors = [
            [summary[task][m]["mean"] - summary[task][m]["min"] for m in models],
            [summary[task][m]["max"] - summary[task][m]["mean"] for m in models],
        ]
        colors = ["tab:blue" if m.startswith("ran") else "tab:gray" for m in models]
        axis.barh(models, means, xerr=errors, color=colors)
        axis.invert_yaxis()
        metric, lower_is_better = MAIN_METRIC[task]
        axis.set_title(f"{task}: {metric}" + (" (lower is better)" if lower_is_better else ""))
        if task == "probe":
            axis.axvline(0.5, color="tab:red", linestyle="--", linewidth=1)
        axis.tick_params(axis="y", labelsize=8)
    if study:
        axis = axes[len(panels)]
        entries = sorted(summary["window_study"].items(), key=lambda item: int(item[0].split("-w")[1]))
        windows = [int(model.split("-w")[1]) for model, _ in entries]
        axis.errorbar(
            windows,
            [e["mean"] for _, e in entries],
            yerr=[[e["mean"] - e["min"] for _, e in entries], [e["max"] - e["mean"] for _, e in entries]],
            marker="o",
            color="tab:blue",
        )
        axis.set_xscale("log", base=2)
        axis.set_xlabel("window size")
        axis.set_ylabel("accuracy", color="tab:blue")
        twin = axis.twinx()
        twin.plot(windows, [e["mean_seconds_per_epoch"] for _, e in entries], marker="v", color="tab:green")
        twin.set_ylabel("training s / epoch", color="tab:green")
        axis.set_title("window size (Hyperpartisan)")
    for axis in axes[count:]:
        axis.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(results: list[dict], args, info: dict, stem: Path, command: str) -> dict:
    """Write <stem>.json (summary and every run), <stem>.md and <stem>.png; return the record written."""
    summary = summarize(results)
    settings = {key: value for key, value in vars(args).items() if key not in ("output_dir", "cache_dir", "data_dir")}
    figures = {"summary": summary, "classification_average": classification_average(summary), "runs": results}
    payload = result_record(command, settings, figures, device=args.device, dtype="float32", info=info)
    write_result(result_path(stem, ".json"), json.dumps(payload, indent=1) + "\n")
    write_result(result_path(stem, ".md"), markdown(summary, results, args, info, command))
    plot(summary, result_path(stem, ".png"))
    return payload
