"""Files read through `datasets` (`ran_hf.files.data.load_records` + `check_texts`) hold what the record reader gives
and fail with the record reader's errors (file, line, column); `read_records(limit=N)` reads only the first N
records."""

import csv
import gzip
import json

import pytest

from ran_hf.files.data import check_columns, check_texts, load_records, read_records


LONG_FIELD = "word " * 40_000  # 200 KB: longer than the csv module's default field limit


def write(path, content: str):
    data = content.encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def read_by_records(path, columns, optional_columns=(), text_columns=()):
    """What the scripts read before `datasets`: every record, its texts checked, the kept columns."""
    records = read_records(path, text_columns)
    kept = list(columns) + [column for column in optional_columns if column in records[0]]
    check_columns(records, kept, str(path))
    return [{column: record[column] for column in kept} for record in records]


def read_through_arrow(path, columns, optional_columns=(), text_columns=(), cache_dir=None):
    dataset = load_records(path, columns, optional_columns, text_columns, cache_dir=cache_dir)
    check_texts(dataset, text_columns, str(path), path)
    return dataset


@pytest.mark.parametrize(
    "name, content",
    [
        pytest.param("data.jsonl", '{"text": "a", "label": 1}\n\n{"text": "b", "label": 2}\n', id="jsonl"),
        pytest.param("data.jsonl.gz", '{"text": "a", "label": ["x", "y"]}\n{"text": "b", "label": []}\n', id="gz"),
        pytest.param("bom.jsonl", '\ufeff{"text": "a", "label": true}\n{"text": "b", "label": false}\n', id="bom"),
        pytest.param("nested.jsonl", '{"text": "a", "label": {"name": "x"}}\n', id="object-label"),
        pytest.param("no-label.jsonl", '{"text": "a"}\n{"text": "b"}\n', id="no-optional-column"),
        pytest.param(
            "data.csv", 'text,label\nNA,\n"multi\nline, quoted",None\n' + f'"{LONG_FIELD}",1\n', id="csv-strings"
        ),
        pytest.param("bom.csv", "\ufefftext,label\na,b\n\nc,d\n", id="csv-bom-blank-line"),
        pytest.param("data.tsv", 'text\tlabel\n"a, b"\tx\nc\ty\n', id="tsv"),
        pytest.param("data.txt", "\ufeff  first line \n\n   \nsecond\r\nthird\n", id="text"),
        pytest.param("data.txt.gz", "one\n\ntwo\n", id="text-gz"),
    ],
)
def test_arrow_holds_what_the_record_reader_gives(tmp_path, name, content):
    path = write(tmp_path / name, content)
    dataset = read_through_arrow(path, ["text"], ["label"], ["text"], cache_dir=tmp_path / "cache")
    assert dataset.to_list() == read_by_records(path, ["text"], ["label"], ["text"])
    assert dataset.cache_files  # memory-mapped from the datasets cache, not held in memory


BAD_FILES = [
    pytest.param("null.jsonl", '{"text": "a"}\n\n{"text": null}\n', "line 3: column 'text' holds null", id="null"),
    pytest.param("blank.jsonl", '{"text": "a"}\n{"text": " \\t "}\n', "line 2: .* only whitespace", id="blank"),
    pytest.param("number.jsonl", '{"text": 12}\n', "line 1: column 'text' holds int 12", id="number"),
    pytest.param("array.jsonl", '[{"text": "a"}]\n', "line 1: expected a JSON object, got the start", id="array"),
    pytest.param("pretty.jsonl", '{\n  "text": "a"\n}\n', "line 1: not valid JSON", id="pretty-printed"),
    pytest.param("broken.jsonl", '{"text": "a"}\n{"text": \n', "line 2: not valid JSON", id="broken-line"),
    pytest.param(
        "surrogate.jsonl", '{"text": "a"}\n{"text": "x\\ud800"}\n', "line 2: .* lone surrogate", id="surrogate"
    ),
    pytest.param(
        "missing.jsonl", '{"text": "a"}\n{"body": "b"}\n', r"\(record 2\) has no column 'text'", id="missing"
    ),
    pytest.param(
        "mixed.jsonl",
        '{"text": "a", "label": "x"}\n{"text": "b", "label": ["y"]}\n',
        r"column 'label' mixes a string \(record 1\) and a list \(record 2\)",
        id="mixed",
    ),
    pytest.param("latin.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', "line 2: not valid UTF-8", id="latin-jsonl"),
    pytest.param("latin.csv", b"text\na\ncaf\xe9\n", "line 3: not valid UTF-8", id="latin-csv"),
    pytest.param("latin.txt", b"a\ncaf\xe9\n", "line 2: not valid UTF-8", id="latin-text"),
    pytest.param("blank.csv", "text,label\na,b\n   ,c\n", "line 3: .* only whitespace", id="csv-blank"),
    pytest.param("long.csv", "text,label\na,b\nc,d,e\n", "line 3: 2 columns in the header", id="csv-long-row"),
    pytest.param("short.csv", "text,label\na,b\nc\n", "line 3: 2 columns in the header .* 1 in this row", id="short"),
    pytest.param("quote.csv", 'text,label\na,x\n"b" c,y\n', r"line 3: not valid CSV \(',' expected", id="csv-quote"),
    pytest.param("open.csv", 'text,label\na,x\n"b never closed,y\nc,x\n', "line 3: not valid CSV", id="open-quote"),
    pytest.param("empty.jsonl", "\n\n", "holds no examples", id="empty"),
]


@pytest.mark.parametrize("name, content, message", BAD_FILES)
def test_arrow_fails_with_the_record_readers_error(tmp_path, name, content, message):
    """Arrow's own errors name neither file nor line (pyarrow even takes bytes that are not UTF-8, and pandas a
    short CSV row): the record reader names them, and the message is the one it gives by itself."""
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    columns = ["text"]
    with pytest.raises(ValueError, match=message) as by_records:
        read_by_records(path, columns, ["label"], ["text"])
    with pytest.raises(ValueError, match=message) as through_arrow:
        read_through_arrow(path, columns, ["label"], ["text"], cache_dir=tmp_path / "cache")
    assert str(through_arrow.value) == str(by_records.value)


def test_a_null_label_that_the_file_holds_is_kept_for_the_label_checks(tmp_path):
    """A record without the column is an error here; a null the file itself holds is the label checks' to name."""
    path = write(tmp_path / "data.jsonl", '{"text": "a", "label": "x"}\n{"text": "b", "label": null}\n')
    dataset = load_records(path, ["text", "label"], cache_dir=tmp_path / "cache")
    assert dataset["label"] == ["x", None]


def test_only_the_texts_checked_are_read(tmp_path):
    """check_texts over the first records passes though a later one is null: --max_*_samples checks what it keeps."""
    records = [{"text": f"document {i}", "label": "ab"[i % 2]} for i in range(5)] + [{"text": None, "label": "a"}]
    path = write(tmp_path / "data.jsonl", "".join(json.dumps(record) + "\n" for record in records))
    dataset = load_records(path, ["text", "label"], text_columns=["text"], cache_dir=tmp_path / "cache")
    check_texts(dataset.select(range(5)), ["text"], str(path), path)
    with pytest.raises(ValueError, match="data.jsonl, line 6: column 'text' holds null"):
        check_texts(dataset, ["text"], str(path), path)
    with pytest.raises(ValueError, match=r"the corpus, example 6: column 'text' holds null"):
        check_texts(dataset, ["text"], "the corpus")  # without a file: the example


def test_the_first_records_are_read_without_the_rest(tmp_path):
    """`limit` stops reading: a broken line after the first records is never reached, and the csv module's field
    limit, raised while reading, is restored at once."""
    path = write(tmp_path / "data.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": \n')
    assert read_records(path, ["text"], limit=2) == [{"text": "a"}, {"text": "b"}]
    with pytest.raises(ValueError, match="line 3: not valid JSON"):
        read_records(path, ["text"])
    limit = csv.field_size_limit()
    path = write(tmp_path / "data.csv", f'text\n"{LONG_FIELD}"\nb\n"never closed\n')
    assert read_records(path, ["text"], limit=2) == [{"text": LONG_FIELD}, {"text": "b"}]
    assert csv.field_size_limit() == limit
