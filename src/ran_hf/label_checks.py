"""Label checks of the RAN heads, and the loss preludes they share. Shapes and dtypes are checked at once; values are
gathered as `InputChecks` (input_checks.py), which a head reads in one host synchronisation before it runs its base
model. A loss never reads the device to find a batch with nothing to score: it is 0 there, not the NaN of an empty
mean."""

import torch
import torch.nn.functional as F

from .configuration_ran import RANConfig
from .input_checks import InputChecks


def ignore_padding(labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Token labels at padding positions never count, whatever the caller put there."""
    if attention_mask is None:
        return labels
    return labels.masked_fill(~attention_mask.bool().to(labels.device), -100)


def sequence_loss(loss_function, logits, labels, problem_type: str, attention_mask, config: RANConfig, **kwargs):
    """A sequence classifier's loss over the rows that hold a token (a row of padding alone carries no document),
    without reading the device to find them: their labels are ignored (-100) in single-label classification, whose
    loss is then the mean over the scored rows (0, not NaN, when there is none); for regression and multi-label
    classification, their logits are replaced by ones of no loss and the mean is taken over the other rows."""
    labels = labels.to(logits.device)
    has_tokens = None if attention_mask is None else attention_mask.bool().any(-1).to(logits.device)  # (B,)
    if problem_type == "single_label_classification":
        if has_tokens is not None:
            labels = labels.masked_fill(~has_tokens, -100)
        if kwargs.get("num_items_in_batch") is None:
            kwargs["num_items_in_batch"] = (labels != -100).sum().clamp(min=1)
        return loss_function(labels=labels, pooled_logits=logits, config=config, **kwargs)
    if has_tokens is None:
        return loss_function(labels=labels, pooled_logits=logits, config=config, **kwargs)
    if problem_type == "regression":
        no_loss = labels.reshape(logits.shape).to(logits.dtype)  # no error
    else:  # the binary cross-entropy of a logit of 1000 for a target of 1 is 0 (exp(-1000) is 0 in every dtype)
        no_loss, labels = torch.full_like(logits, 1000.0), torch.where(has_tokens[:, None], labels, 1.0)
    logits = torch.where(has_tokens.view(-1, *[1] * (logits.dim() - 1)), logits, no_loss)
    loss = loss_function(labels=labels, pooled_logits=logits, config=config, **kwargs)
    return loss * (has_tokens.shape[0] / has_tokens.sum().clamp(min=1))


def check_num_items_in_batch(num_items_in_batch, read_device: bool = False) -> None:
    """Refuse a `num_items_in_batch` below 1, which a summed loss would be divided by (inf or NaN, as Transformers'
    losses give). A number, or a tensor on the CPU, is read; one on an accelerator only where the caller
    synchronises anyway (`read_device`)."""
    count = num_items_in_batch
    if torch.is_tensor(count):
        if count.device.type != "cpu" and not read_device:
            return
        count = count.min().item() if count.numel() else 0
    if count is not None and not count > 0:
        raise ValueError(
            f"`num_items_in_batch` (the number of scored labels the loss is divided by) must be >= 1, got "
            f"{count!r}: the summed loss divided by it would be inf or NaN, as Transformers' losses "
            "give. Pass the number of labels that are not -100 (Trainer counts them), or None to average over this "
            "batch."
        )


def scored_token_loss(loss_function, logits, labels, scored, **kwargs) -> torch.Tensor:
    """A token head's loss without reading the device to find a batch with nothing to score: unless the caller
    (Trainer) counts the items itself, `num_items_in_batch` is the number of scored labels, at least 1, so the loss
    is the mean over scored tokens, and 0 with zero gradients where there are none (not the NaN of an empty mean)."""
    check_num_items_in_batch(kwargs.get("num_items_in_batch"))
    if kwargs.get("num_items_in_batch") is None:
        kwargs["num_items_in_batch"] = (scored != -100).sum().clamp(min=1)
    return loss_function(logits, labels, **kwargs)


def check_labels_tensor(labels) -> None:
    if not torch.is_tensor(labels):
        raise ValueError(
            f"`labels` must be a tensor, got {type(labels).__name__}: pass `torch.tensor(labels)` (a data collator "
            "does this for `Trainer`)."
        )


def check_token_labels(labels: torch.Tensor, batch_shape: tuple, num_classes: int, name: str) -> InputChecks:
    """Shape and dtype now; the values' range is returned, for the head to read before it runs the base model."""
    check_labels_tensor(labels)
    if tuple(labels.shape) != batch_shape:
        raise ValueError(f"`labels` must have shape {batch_shape} (one {name} per token), got {tuple(labels.shape)}.")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"`labels` must hold integer {name}s, got dtype {labels.dtype}.")
    scored = labels.masked_fill(labels == -100, 0)

    def judge(found: list) -> None:
        low, high = found
        if low < 0 or high >= num_classes:
            raise ValueError(
                f"`labels` holds a {name} outside [0, {num_classes - 1}] (use -100 to ignore a position)."
            )

    return InputChecks(torch.stack([scored.min(), scored.max()]).long(), judge)


def check_sequence_labels(labels: torch.Tensor, batch_size: int, config: RANConfig):
    """A sequence classifier's labels, for the configured (or inferred, as Transformers does) problem type: shapes
    and dtypes now; their values returned as `InputChecks`, whose judge raises on a bad one, for the head to read in
    one host synchronisation before it runs the base model. Returns the labels (float for multi-label classification
    and regression), the problem type and the checks."""
    check_labels_tensor(labels)
    num_labels, problem_type = config.num_labels, config.problem_type
    if problem_type is None:
        if num_labels == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if labels.dim() == 0 or labels.shape[0] != batch_size:
        raise ValueError(f"`labels` must have one row per example ({batch_size}), got shape {tuple(labels.shape)}.")
    if problem_type == "single_label_classification":
        if labels.is_floating_point() or labels.dim() != 1:
            raise ValueError(
                f"Single-label classification needs integer labels of shape ({batch_size},), got "
                f"{labels.dtype} of shape {tuple(labels.shape)}."
            )
        scored = labels.masked_fill(labels == -100, 0)
        values = [scored.min(), scored.max()]
    elif problem_type == "multi_label_classification":
        if tuple(labels.shape) != (batch_size, num_labels):
            chosen = (
                ""
                if config.problem_type
                else f" (chosen from the labels' dtype {labels.dtype}: pass integer class ids for single-label "
                "classification, or set `config.problem_type`)"
            )
            raise ValueError(
                f"Multi-label classification{chosen} needs labels of shape ({batch_size}, {num_labels}), "
                f"got {tuple(labels.shape)}."
            )
        labels = labels.float()
        outside = ~((labels >= 0) & (labels <= 1))  # NaN fails too
        values = [outside.any()]
    else:
        if labels.numel() != batch_size * num_labels:
            raise ValueError(
                f"Regression needs {num_labels} target(s) per example, got labels of shape {tuple(labels.shape)}."
            )
        labels = labels.float()
        values = [(~torch.isfinite(labels)).any()]

    def judge(checked: list) -> None:
        if problem_type == "single_label_classification":
            low, high = checked
            if low < 0 or high >= num_labels:
                raise ValueError(f"`labels` holds a class outside [0, {num_labels - 1}].")
        elif problem_type == "multi_label_classification" and checked[0]:
            shown = labels[outside][0].item()  # read only on the way to the error
            raise ValueError(
                f"Multi-label classification needs targets in [0, 1] (1: the class applies), got {shown}."
            )
        elif problem_type == "regression" and checked[0]:
            raise ValueError("Regression targets hold NaN or infinite values.")

    return labels, problem_type, InputChecks(torch.stack([value.long() for value in values]), judge)


def check_answer_positions(start_positions, end_positions, attention_mask, batch_shape: tuple):
    """A span head's answers, in Transformers' convention: a position at or past the end of the input
    (`sequence_length`, where its loss clamps them) marks an answer the loss ignores; here so does a position on
    padding. Shapes and dtypes are checked now; whether a position is negative (Transformers would clamp it to 0 and
    score the first token), or an answer ignored at one end only, or ends before it starts, is returned as
    `InputChecks`, for the head to read before it runs the base model. Returns both positions with the ignored ones
    at `sequence_length`, how many answers are scored (at least 1: the divisor of a loss that is 0 when there are
    none), and the checks."""
    batch_size, length = batch_shape
    positions = {"start_positions": start_positions, "end_positions": end_positions}
    for name, value in positions.items():
        if not torch.is_tensor(value):
            example = f"torch.tensor({value!r})" if isinstance(value, list | tuple) else "torch.tensor([...])"
            raise ValueError(
                f"`{name}` must be a tensor of shape (batch_size,), one token index per example, e.g. {example}, got "
                f"{type(value).__name__}."
            )
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool or value.numel() != batch_size:
            raise ValueError(
                f"`{name}` must hold one integer token index per example ({batch_size}), got {value.dtype} of "
                f"shape {tuple(value.shape)}."
            )
    start, end = (value.reshape(batch_size).long() for value in positions.values())
    real = None
    if attention_mask is not None and tuple(attention_mask.shape) == batch_shape:  # else refused by the base model
        real = F.pad(attention_mask.bool(), (0, 1)).to(start.device)

    def on_text(position: torch.Tensor) -> torch.Tensor:
        inside = (position >= 0) & (position < length)
        if real is None:
            return inside
        return inside & real.gather(1, position.clamp(0, length)[:, None]).squeeze(1)

    start_on_text, end_on_text = on_text(start), on_text(end)
    negative = (start < 0) | (end < 0)
    half = start_on_text != end_on_text
    reversed_span = start_on_text & end_on_text & (start > end)
    values = torch.stack([negative.any(), half.any(), reversed_span.any()]).long()

    def judge(found: list) -> None:
        if found[0]:
            for name, value in (("start_positions", start), ("end_positions", end)):
                if (value < 0).any():
                    row = int((value < 0).nonzero()[0, 0])
                    raise ValueError(
                        f"`{name}` holds {int(value[row])} (example {row}): a negative position is outside the input "
                        f"(Transformers' loss would clamp it to 0 and score the first token). To leave an answer out "
                        f"of the loss, give both positions `sequence_length` ({length}) or more."
                    )
        if found[1]:
            row = int(half.nonzero()[0, 0])
            inside, outside = ("start", "end") if start_on_text[row] else ("end", "start")
            shown = {"start": int(start[row]), "end": int(end[row])}
            raise ValueError(
                f"The answer of example {row} has its `{inside}_positions` ({shown[inside]}) on the text, but its "
                f"`{outside}_positions` ({shown[outside]}) is not on it (past the input or on padding), which marks "
                f"an ignored answer. Ignore an answer as a whole (both positions `sequence_length` ({length}) or "
                "more), or give both of its tokens."
            )
        if found[2]:
            row = int(reversed_span.nonzero()[0, 0])
            raise ValueError(
                f"The answer of example {row} starts after it ends: `start_positions` ({int(start[row])}) after "
                f"`end_positions` ({int(end[row])}). Give the indices of its first and last tokens."
            )

    scored = start_on_text.sum().clamp(min=1)
    ignoring = start.masked_fill(~start_on_text, length), end.masked_fill(~end_on_text, length)
    return *ignoring, scored, InputChecks(values, judge)
