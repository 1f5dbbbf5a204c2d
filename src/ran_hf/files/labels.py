"""The labels of a classification or tagging task, inferred from the data of every split and checked before training:
`ClassificationLabels` (a document's class, or several) and `TagLabels` (a token's tag). Missing, mixed or unseen
labels, and class names that differ only in the whitespace around them ("1" and " 1"), are refused; given the files,
an error names a bad label's file and line."""

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .data import iter_records, label_kind, label_name


class UnknownLabelsError(ValueError):
    """Labels of the data outside a fixed set of classes (a trained model's, or a Hub `ClassLabel`'s)."""


@dataclass(frozen=True)
class ClassificationLabels:
    """The classes of a document classification task and whether a document may carry several of them."""

    names: tuple[str, ...]
    multi_label: bool

    @classmethod
    def from_splits(
        cls,
        splits: Mapping[str, Sequence],
        column: str,
        names: Sequence[str] | None = None,
        names_from: str = "the dataset's ClassLabel feature",
        paths: Mapping[str, str | Path | None] | None = None,
    ) -> "ClassificationLabels":
        """Infer the task from the label values of every split (`{"train": [...], "validation": [...]}`).

        All values must be of one kind: single labels (str / int / bool) or lists of them (multi-label). Single-label
        classes are those of the training split (or of the first split, without one) and the other splits may only
        use those; multi-label classes are the union over the splits, so that labels seen only in evaluation count as
        misses, and the training split must use at least one. `names` (a Hub `ClassLabel` feature's, or a trained
        model's) fixes the classes and their order instead: every label must be one of them (`names_from` says whose
        they are in the error), and a split may use only some.

        `paths` (`{"train": file, ...}`, the files the splits were read from) lets an error name a file, and a bad
        label its line: the file is read again, record by record (`iter_records`), up to that label. The split's
        index alone may blame another record: Arrow reads a column of ints and one float (NaN, say) as floats.
        """
        paths = {split: path for split, path in (paths or {}).items() if path is not None}
        kinds = {}  # "single" / "multi" -> the first example of that kind
        for split, values in splits.items():
            for index, value in enumerate(values):
                source = f"{split} example {index + 1}"
                try:
                    kind = label_kind(value, source, column)
                except ValueError:
                    if split in paths:  # the file's reader names the first bad label, with its line
                        for _ in iter_records(paths[split], label_columns=[column]):
                            pass
                    raise
                kinds.setdefault(kind, source)
                if len(kinds) > 1:
                    raise ValueError(
                        f"Column {column!r} mixes single labels ({kinds['single']}) and lists of labels "
                        f"({kinds['multi']}): use one or the other throughout."
                    )
        if not kinds:
            raise ValueError(f"No labels found in column {column!r}.")
        multi_label = "multi" in kinds

        if names is not None:
            names = tuple(str(name) for name in names)
            found = {
                label_name(item, split, column)
                for split, values in splits.items()
                for value in values
                for item in (value if multi_label else [value])
            }
            unknown = found - set(names)
            if unknown:
                raise UnknownLabelsError(
                    f"Column {column!r} holds labels that {names_from} does not have: {sort_names(unknown)[:10]}"
                    f"{' ...' if len(unknown) > 10 else ''} (its classes: {list(names[:10])}"
                    f"{' ...' if len(names) > 10 else ''})."
                )
            return cls(names, multi_label)
        reference = "train" if "train" in splits else next(iter(splits))
        if multi_label:
            if not any(len(row) for row in splits[reference]):
                where = paths.get(reference, f"The {reference} split")
                raise ValueError(
                    f"{where}: column {column!r} holds only empty lists of labels ({len(splits[reference]):,} "
                    "examples): a multi-label classifier learns its classes from the labels, and there is none. "
                    "Check --label_column_name and the file."
                )
            found = {label_name(item, split, column) for values in splits.values() for row in values for item in row}
            check_distinct_names(found, column)
            return cls(tuple(sort_names(found)), True)
        known = {label_name(value, reference, column) for value in splits[reference]}
        check_distinct_names(known, column)
        for split, values in splits.items():
            unseen = {label_name(value, split, column) for value in values} - known
            if unseen:
                raise ValueError(
                    f"The {split} split has labels the {reference} split never uses: {sort_names(unseen)[:10]} "
                    f"(known: {sort_names(known)[:10]}{' ...' if len(known) > 10 else ''}). Check "
                    "--label_column_name and the files."
                )
        if len(known) < 2:
            raise ValueError(f"Column {column!r} of the {reference} split holds a single class {sorted(known)}.")
        return cls(tuple(sort_names(known)), False)

    @cached_property
    def label2id(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self.names)}

    def encode(self, value) -> int | list[int]:
        """The class id of one example's label (single-label), or the sorted ids of its labels (multi-label)."""
        label2id = self.label2id
        if self.multi_label:
            return sorted({label2id[label_name(item, "label", "label")] for item in value})
        return label2id[label_name(value, "label", "label")]


def check_distinct_names(names: Iterable[str], column: str) -> None:
    """Class names that differ only in whitespace around them (`"1"` and `" 1"`, from a CSV written with ", " between
    its fields) would be two classes of one label: refused, naming both."""
    seen = {}
    for name in sort_names(names):
        first = seen.setdefault(name.strip(), name)
        if first != name:
            raise ValueError(
                f"Column {column!r} holds the labels {first!r} and {name!r}, which differ only in the whitespace "
                "around them, so they would be two classes. Strip the labels in the file (a CSV written with ', ' "
                "between its fields?), or rename one of them."
            )


def sort_names(names: Iterable[str]) -> list[str]:
    """Numeric names in numeric order ("2" before "10"), then the rest alphabetically."""
    return sorted(names, key=lambda name: (0, int(name), "") if name.lstrip("-").isdigit() else (1, 0, name))


@dataclass(frozen=True)
class TagLabels:
    """The tag set of a token classification task ("O" first, then the others in alphabetical order)."""

    names: tuple[str, ...]

    @classmethod
    def from_splits(
        cls,
        splits: Mapping[str, Sequence[Sequence[str]]],
        names: Sequence[str] | None = None,
        names_from: str = "the dataset's ClassLabel feature",
        where: Callable[[str, int], str] | None = None,
    ):
        """Tags of every sentence of every split; tags outside the training split's set are an error. `names` (a
        trained model's, say) fixes the tags and their order instead; tags outside them are an error. With `where`
        (`where(split, index)` names sentence `index` of `split`: its file and line, say), the error also names the
        first sentence holding such a tag."""

        def first(split_names, bad) -> str:  # searched only for the error
            if where is None:
                return ""
            for split in split_names:
                for index, sentence in enumerate(splits[split]):
                    if not bad.isdisjoint(sentence):
                        tag = next(tag for tag in sentence if tag in bad)
                        return f" The first, {tag!r}, is in {where(split, index)}."
            return ""

        if names is not None:
            unknown = {tag for sentences in splits.values() for sentence in sentences for tag in sentence} - set(names)
            if unknown:
                raise UnknownLabelsError(
                    f"The data has tags that {names_from} does not have: {sorted(unknown)[:10]} (its tags: "
                    f"{list(names[:20])}{' ...' if len(names) > 20 else ''}).{first(splits, unknown)}"
                )
            return cls(tuple(names))
        reference = "train" if "train" in splits else next(iter(splits))
        known = {tag for sentence in splits[reference] for tag in sentence}
        for split, sentences in splits.items():
            unseen = {tag for sentence in sentences for tag in sentence} - known
            if unseen:
                raise ValueError(
                    f"The {split} split has tags the {reference} split never uses: {sorted(unseen)[:10]}."
                    f"{first([split], unseen)} Check the tag column and the files."
                )
        ordered = (["O"] if "O" in known else []) + sorted(known - {"O"})
        return cls(tuple(ordered))

    @cached_property
    def label2id(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self.names)}


__all__ = ["ClassificationLabels", "TagLabels", "UnknownLabelsError"]
