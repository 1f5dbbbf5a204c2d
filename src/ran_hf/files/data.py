"""Readers for the files the training scripts accept, and the checks that reject bad data before training starts.

Formats, chosen by the file name:

* `.jsonl`, `.json` (one object per line), optionally gzipped (`.jsonl.gz`): Hyperpartisan, 20 Newsgroups, EURLEX-57K.
* `.csv`, `.tsv` with a header row.
* `.txt` and anything else: plain text, one record `{"text": line}` per non-blank line.
* CoNLL (`read_conll`): one token per line, whitespace-separated columns (token first, tag last), a blank line between
  sentences, `-DOCSTART-` lines ignored: CoNLL-2003's four columns, or two.

Two ways in. `load_records` reads a file with `datasets.load_dataset` into Arrow, memory-mapped from the `datasets`
cache (benchmarks/data_loading/data_loading_cpu.md), and `check_texts` checks its texts as a batched map.
`read_records` / `iter_records` read record by record in Python (the first `limit` records); they are also the
diagnosis: where Arrow fails or a check finds a bad value, the file is read again this way up to the bad record, so
that every error names the file and line.

Every reader raises `ValueError` naming the file (and line) for an empty file, a malformed line, text that is not
UTF-8 or a cut `.gz` (text_files.py), a column name held twice, or (with `text_columns`) a text that is null, empty
or blank, (with `label_columns`) a label that is no class name. A task's labels are checked across splits: labels.py.
"""

import csv
import itertools
import json
import logging
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from pathlib import Path

from datasets import Dataset, Features, LargeList, List, Value, load_dataset
from datasets.exceptions import DatasetGenerationError
from pyarrow import ArrowException

from .text_files import GZIP_ERRORS, read_lines


logger = logging.getLogger(__name__)

DOCSTART = "-DOCSTART-"


def file_format(path: str | Path) -> str:
    """ "jsonl", "csv", "tsv" or "text", from the file name (a trailing `.gz` is ignored)."""
    suffixes = Path(path).suffixes
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    suffix = suffixes[-1] if suffixes else ""
    return {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv"}.get(suffix, "text")


def check_unicode(value: str, where: str, column: str) -> None:
    """A string must be valid Unicode: JSON may escape half of a UTF-16 pair ("\\ud800"), which no UTF-8 text, Arrow
    column or tokenizer can hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{where}: column {column!r} holds a lone surrogate {value[error.start]!r} at character "
            f"{error.start + 1} (half of a UTF-16 pair, escaped in JSON), which is not text. Fix the file."
        ) from None


def check_text(value, where: str, column: str) -> None:
    """A document's text must be a string with something besides whitespace in it, and valid Unicode."""
    if isinstance(value, str) and value.strip():
        check_unicode(value, where, column)
        return
    if value is None:
        kind = "null"
    elif isinstance(value, str):
        kind = "an empty string" if not value else "only whitespace"
    else:
        kind = f"{type(value).__name__} {value!r}, not text"
    raise ValueError(f"{where}: column {column!r} holds {kind}. Every example needs a text; remove or fix it.")


class _RepeatedKeyError(ValueError):
    """A JSON object names a key twice (raised by `_unique_keys`, reported by `jsonl_records` with the line)."""


def _unique_keys(pairs: list[tuple]) -> dict:
    """`json.loads`' object hook: `json` would keep the last of two equal keys, Arrow the first."""
    record = dict(pairs)
    if len(record) != len(pairs):
        seen = set()
        raise _RepeatedKeyError(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return record


def jsonl_records(
    path: str | Path, text_columns: Iterable[str] = (), label_columns: Iterable[str] = ()
) -> Iterator[dict]:
    """One JSON object per non-blank line, no key twice in one object; the `text_columns` it holds must be non-blank
    strings, the `label_columns` labels (`label_kind`)."""
    text_columns, label_columns = tuple(text_columns), tuple(label_columns)
    first = True
    for line_number, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            continue
        if first and line.lstrip().startswith("["):
            raise ValueError(
                f"{path}, line {line_number}: expected a JSON object, got the start of a JSON array. This reader "
                f"takes JSON Lines, one object per line: convert the array with `jq -c '.[]' {Path(path).name}`."
            )
        try:
            record = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {line_number}: not valid JSON ({error.msg}).") from None
        except _RepeatedKeyError as error:
            raise ValueError(
                f"{path}, line {line_number}: an object names the key {error.args[0]!r} more than once, so which "
                "value is meant is ambiguous (readers keep either the first or the last). Keep one of them."
            ) from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {line_number}: expected a JSON object, got {type(record).__name__}.")
        for column, value in record.items():
            if column in text_columns:
                check_text(value, f"{path}, line {line_number}", column)
            for string in value if isinstance(value, list) else [value]:
                if isinstance(string, str):  # a label or a token, too: Arrow could not store it
                    check_unicode(string, f"{path}, line {line_number}", column)
            if column in label_columns:
                label_kind(value, f"{path}, line {line_number}", column)
        first = False
        yield record


class _LineCounter:
    """Feeds lines to `csv.reader` and counts them, so that a record's first line is known even when a quoted field
    spans several lines."""

    def __init__(self, lines: Iterator[str]):
        self.lines, self.line_number = lines, 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = next(self.lines)
        self.line_number += 1
        return line


@contextmanager
def long_csv_fields():
    """Lets the csv module read fields as long as a document is (its default limit, 128 KB, is shorter than many)."""
    limit = csv.field_size_limit()
    csv.field_size_limit(sys.maxsize)
    try:
        yield
    finally:
        csv.field_size_limit(limit)


def delimited_records(
    path: str | Path, delimiter: str, text_columns: Iterable[str] = (), label_columns: Iterable[str] = ()
) -> Iterator[dict]:
    """A CSV or TSV file whose first row names the columns, each once; the `text_columns` it has must not be blank,
    the `label_columns` not empty.

    Quoting is strict (a quote left open or text after a closing quote is an error, reported at the line where the
    record starts), and fields may be as long as a document is. `load_records` reads the header here too, so a
    column named twice is refused whichever way the file is read.
    """
    text_columns, label_columns = tuple(text_columns), tuple(label_columns)
    lines = _LineCounter(read_lines(path))
    reader = csv.reader(lines, delimiter=delimiter, strict=True)
    with long_csv_fields():
        header = None
        while True:
            start = lines.line_number + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as error:
                kind = "CSV" if delimiter == "," else "TSV"
                hint = ""
                if "new-line character seen in unquoted field" in str(error):  # Python's advice does not apply here
                    error = "a carriage return (\\r) outside quotes"
                    hint = (
                        " Its lines end in a lone \\r (old Mac OS line endings), or a field holds a stray one: end "
                        "the lines with \\n (`tr '\\r' '\\n'`, `dos2unix -c mac`), or quote the field."
                    )
                raise ValueError(f"{path}, line {start}: not valid {kind} ({error}).{hint}") from None
            if not row:
                continue  # a blank line
            if header is None:
                repeated = [column for index, column in enumerate(row) if column in row[:index]]
                if repeated:
                    raise ValueError(
                        f"{path}, line {start}: the header names column {repeated[0]!r} more than once ({row}), so "
                        "which of them is meant is ambiguous (readers take either the first or the last). Rename or "
                        "remove the duplicate."
                    )
                header = row
                continue
            if len(row) != len(header):
                raise ValueError(
                    f"{path}, line {start}: {len(header)} columns in the header {header}, {len(row)} in this row."
                )
            record = dict(zip(header, row))
            for column in text_columns:
                if column in record:
                    check_text(record[column], f"{path}, line {start}", column)
            for column in label_columns:
                if column in record:
                    label_kind(record[column], f"{path}, line {start}", column)
            yield record


def text_records(path: str | Path) -> Iterator[dict]:
    """Plain text: every non-blank line is one record `{"text": line}`, stripped. A line ends at "\n", "\r\n" or a
    lone "\r" (old Mac OS line endings), as Python's universal newlines and `datasets`' text reader (`load_records`)
    end it, so that both readers give the same records."""
    for line in read_lines(path):
        for piece in line.split("\r"):
            if piece.strip():
                yield {"text": piece.strip()}


def iter_records(
    path: str | Path, text_columns: Iterable[str] = (), limit: int | None = None, label_columns: Iterable[str] = ()
) -> Iterator[dict]:
    """The records of a jsonl / csv / tsv / text file one at a time (see the module docstring), checked as they are
    read: a null, empty or blank value in one of `text_columns`, or a value of one of `label_columns` that is no label
    (`label_kind`), is an error naming the file and line. With `limit`, reading stops after that many records: the
    rest of the file is never read."""
    kind = file_format(path)
    if kind == "jsonl":
        records = jsonl_records(path, text_columns, label_columns)
    elif kind in ("csv", "tsv"):
        records = delimited_records(path, "," if kind == "csv" else "\t", text_columns, label_columns)
    else:
        records = text_records(path)
    with closing(records):  # stopping early closes the file (and restores the csv module's field limit) at once
        yield from itertools.islice(records, limit)


def read_records(
    path: str | Path, text_columns: Iterable[str] = (), limit: int | None = None, label_columns: Iterable[str] = ()
) -> list[dict]:
    """The records of a jsonl / csv / tsv / text file (`iter_records`, at most `limit`) as a list; an empty file is an
    error."""
    records = list(iter_records(path, text_columns, limit, label_columns))
    if not records:
        raise ValueError(f"{path} holds no examples (the file is empty or blank).")
    return records


# `datasets` reads CSV with pandas. Its Python engine with this dialect is as strict about quoting as
# `delimited_records`, where the C engine would read `"a" b` as `a b`.
csv.register_dialect("ran_hf-csv", delimiter=",", strict=True)
csv.register_dialect("ran_hf-tsv", delimiter="\t", strict=True)


def load_records(
    path: str | Path,
    columns: Sequence[str] = (),
    optional_columns: Sequence[str] = (),
    text_columns: Iterable[str] = (),
    cache_dir: str | None = None,
    flags: Mapping[str, str] | None = None,
) -> Dataset:
    """A jsonl / csv / tsv / text file as a `datasets.Dataset` with `columns` and those of `optional_columns` that its
    first record holds (a test file without labels, say), read by `datasets.load_dataset` ("json", "csv" or "text")
    into Arrow and memory-mapped from the `datasets` cache (`cache_dir`, else its default), which makes a second read
    of the same file almost free.

    The records hold what `read_records` would give: CSV fields stay strings ("NA" and "" included), plain text keeps
    its non-blank lines, stripped. Every record must hold every kept column, each column one kind of value
    (`check_columns`, which names the flag of a missing column from `flags`). The `text_columns` are checked by
    `check_texts`, so that a script checks (and reads) only the texts it uses; here, only where Arrow cannot read the
    file. A first record that is not a JSON object (a JSON array, say), a missing column, mixed kinds, and what Arrow
    cannot read (bytes that are not UTF-8, a broken line) are named by this module's reader, with the file and line. A file that reader takes but Arrow cannot (values of one
    column that Arrow cannot unify) is read record by record instead, with a warning.
    """
    path = Path(path)
    first = next(iter_records(path), None)  # datasets would take a JSON array, or a single object, as records
    if first is None:
        raise ValueError(f"{path} holds no examples (the file is empty or blank).")
    kept = list(dict.fromkeys([*columns, *(column for column in optional_columns if column in first)]))
    check_columns([first], kept, str(path), flags)
    text_columns = list(text_columns)
    try:
        dataset = arrow_records(path, first, cache_dir).select_columns(kept)
        # pyarrow's JSON reader takes bytes that are not UTF-8 into its strings. The texts are validated where they
        # are read (`check_texts`): reading a whole text column here would touch all of the file's pages.
        for column in kept:
            if column not in text_columns:
                dataset.data.column(column).validate(full=True)
    except (DatasetGenerationError, ArrowException, ValueError, csv.Error, *GZIP_ERRORS) as error:
        check_columns(iter_records(path, text_columns), kept, str(path), flags)  # names the bad record, if any
        logger.warning(f"{path}: Arrow cannot read it ({type(error).__name__}); reading it record by record instead.")
        records = read_records(path)
        return Dataset.from_dict({column: [record[column] for record in records] for column in kept})
    # A record without a kept column holds null there, and a column of several kinds is not a plain Arrow type:
    # the reader names the record (a null that the file itself holds passes, for the label checks to name).
    nulls = any(dataset.data.column(column).null_count for column in kept)
    if nulls or not all(isinstance(dataset.features[column], Value | List | LargeList | dict) for column in kept):
        check_columns(iter_records(path), kept, str(path), flags)
    return dataset


def arrow_records(path: Path, first: dict, cache_dir: str | None) -> Dataset:
    """`datasets.load_dataset` of one file, read as `iter_records` reads it (`first` is its first record)."""
    kind = file_format(path)
    options = {}
    if kind in ("csv", "tsv"):
        options = {
            "features": Features(dict.fromkeys(first, Value("string"))),  # strings, as csv.reader gives them
            "keep_default_na": False,
            "na_filter": False,
            "dialect": f"ran_hf-{kind}",
            "engine": "python",
            "encoding": "utf-8-sig",
        }
    elif kind == "text":
        options = {"encoding": "utf-8-sig"}
    builder = {"jsonl": "json", "csv": "csv", "tsv": "csv", "text": "text"}[kind]
    with long_csv_fields():
        dataset = load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir, **options)
    if kind == "text":
        dataset = dataset.map(
            lambda batch: {"text": [line.strip() for line in batch["text"] if line.strip()]},
            batched=True,
            remove_columns=["text"],
            desc="Dropping blank lines",
        )
    return dataset


def check_texts(
    dataset: Dataset,
    text_columns: Iterable[str],
    source: str,
    path: str | Path | None = None,
) -> None:
    """Every value of `text_columns` must be a non-blank string (`check_text`) of valid UTF-8, checked as a batched
    map.

    A bad value is named as `source`, example N, or, with `path` (the file whose first records `dataset` holds, in
    order), by the file's reader, with its line.
    """
    text_columns = list(text_columns)

    def check(batch, indices):
        try:
            for column in text_columns:
                for index, value in zip(indices, batch[column]):  # bytes that are not UTF-8 fail as they are read
                    check_text(value, f"{source}, example {index + 1}", column)
        except ValueError:
            if path is not None:  # the records before this batch are fine: the reader stops at the bad one
                read_records(path, text_columns, limit=indices[-1] + 1)
            raise

    if text_columns:
        dataset.select_columns(text_columns).map(
            check, batched=True, with_indices=True, desc=f"Checking the texts of {source}"
        )


def read_conll(path: str | Path, with_lines: bool = False) -> list[dict]:
    """Sentences of a CoNLL file as `{"tokens": [...], "ner_tags": [...]}` (the first column and the last), the layout
    of the Hub's `conll2003`; `with_lines` adds `"line"`, the line (1-based) of the sentence's first token, for
    errors that name a sentence by its place in the file.

    Every token line must have as many columns as the first one, and at least two; `-DOCSTART-` lines and the blank
    line after them are skipped.
    """
    sentences, tokens, tags = [], [], []
    num_columns = first_line = None

    def sentence() -> dict:
        return {"tokens": tokens, "ner_tags": tags, **({"line": first_line} if with_lines else {})}

    for line_number, line in enumerate(read_lines(path), start=1):
        columns = line.split()
        if not columns:
            if tokens:
                sentences.append(sentence())
                tokens, tags = [], []
            continue
        if columns[0] == DOCSTART:
            continue
        if num_columns is None:
            if len(columns) < 2:
                raise ValueError(
                    f"{path}, line {line_number}: a CoNLL line needs a token and a tag, got {line.strip()!r}."
                )
            num_columns = len(columns)
        elif len(columns) != num_columns:
            raise ValueError(
                f"{path}, line {line_number}: {len(columns)} columns, but the file started with {num_columns} "
                f"(token ... tag): {line.strip()!r}."
            )
        if not tokens:
            first_line = line_number
        tokens.append(columns[0])
        tags.append(columns[-1])
    if tokens:
        sentences.append(sentence())
    if not sentences:
        raise ValueError(f"{path} holds no sentences (the file is empty or holds only -DOCSTART- lines).")
    return sentences


def jsonl_line(path: str | Path, index: int) -> int:
    """The line (1-based) of record `index` (0-based) of a JSON Lines file: its `index + 1`-th non-blank line, as
    `jsonl_records` and `load_records` read it. Reads the file up to that line, so it is for naming a bad record in an
    error, once, not for every record."""
    records = -1
    for line_number, line in enumerate(read_lines(path), start=1):
        if line.strip():
            records += 1
            if records == index:
                return line_number
    raise IndexError(f"{path} holds {records + 1} records, not {index + 1}.")


def value_kind(value) -> str | None:
    """The kind of a JSON-like value, as far as building a column goes (None: missing, fits any column)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):
        return "list"
    return "object" if isinstance(value, dict) else "string"


def check_columns(
    records: Iterable[Mapping], columns: Iterable[str], source: str, flags: Mapping[str, str] | None = None
) -> None:
    """Every record must hold every one of `columns`, each column one kind of value (all strings, all lists, ...).

    Names the first record that breaks the rule and what it holds, instead of the error a table library would give;
    a missing column, with the flag that chose it (`flags`: column -> flag, such as `--label_column_name`).
    `records` may be an iterator (`iter_records`): they are read once, and none is kept.
    """
    columns = list(columns)
    first_of_kind = {}  # column -> (kind, record number) of its first non-null value
    for index, record in enumerate(records):
        missing = [column for column in columns if column not in record]
        if missing:
            where = "" if index == 0 else f" (record {index + 1})"
            flag = (flags or {}).get(missing[0])
            fix = (
                f"Name the column with {flag}" if flag else "Pick others with --text_column_name / --label_column_name"
            )
            raise ValueError(f"{source}{where} has no column {missing[0]!r}; its columns are {sorted(record)}. {fix}.")
        for column in columns:
            kind = value_kind(record[column])
            if kind is None:
                continue
            first_kind, first_index = first_of_kind.setdefault(column, (kind, index))
            if kind != first_kind:
                raise ValueError(
                    f"{source}: column {column!r} mixes a {first_kind} (record {first_index + 1}) and a {kind} "
                    f"(record {index + 1}): {record[column]!r}. Every record must hold the same kind of value."
                )


def label_kind(value, source: str, column: str) -> str:
    """ "single" or "multi": one example's label, checked: a class name (`label_name`), or for multi-label data a list
    of them. `source` names the example in an error."""
    if value is None:
        raise ValueError(f"{source}: column {column!r} is empty (null); every example needs a label.")
    kind = "multi" if isinstance(value, list | tuple) else "single"
    for item in value if kind == "multi" else [value]:
        if isinstance(item, list | tuple):
            raise ValueError(f"{source}: column {column!r} holds a nested list {value!r}.")
        label_name(item, source, column)
    return kind


def label_name(value, source: str, column: str) -> str:
    """A single label as a class name: strings as they are, ints as digits, booleans as "true"/"false"."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | str) and value != "":
        return str(value)
    kind = "an empty string" if value == "" else f"{type(value).__name__} {value!r}"
    raise ValueError(
        f"{source}: column {column!r} holds {kind}; a class label must be a string, an int or a boolean "
        "(or, for multi-label data, a list of them)."
    )


__all__ = ["check_columns", "check_text", "check_texts", "file_format", "iter_records", "jsonl_line", "label_kind"]
__all__ += ["load_records", "read_conll", "read_records"]
