"""A data file in another encoding than UTF-8 is named with its encoding where its bytes show it (a UTF-16 or UTF-32
byte-order mark, or the zero bytes of UTF-16 text without one), and the error gives the command that converts it:
UTF-16 was told to convert "from latin1", which turns it into text full of NUL characters."""

import codecs
import gzip
import re
import shlex
import shutil
import subprocess

import pytest

from ran_hf.files.data import load_records, read_records


TEXT = '{"text": "café au lait", "label": "x"}\n{"text": "thé", "label": "y"}\n'
CSV = "text,label\ncafé au lait,x\nthé,y\n"


def encoded(text: str, encoding: str, mark: bytes = b"") -> bytes:
    return mark + text.encode(encoding)


WIDE = [
    pytest.param("utf-16", b"", "UTF-16", "its byte-order mark is UTF-16LE's", id="utf-16-mark"),
    pytest.param("utf-16-be", codecs.BOM_UTF16_BE, "UTF-16", "its byte-order mark is UTF-16BE's", id="utf-16be-mark"),
    pytest.param("utf-32", b"", "UTF-32", "its byte-order mark is UTF-32LE's", id="utf-32-mark"),
    pytest.param("utf-32-be", codecs.BOM_UTF32_BE, "UTF-32", "its byte-order mark is UTF-32BE's", id="utf-32be-mark"),
    pytest.param("utf-16-le", b"", "UTF-16LE", "no byte-order mark", id="utf-16le-no-mark"),
    pytest.param("utf-16-be", b"", "UTF-16BE", "no byte-order mark", id="utf-16be-no-mark"),
]


@pytest.mark.parametrize("suffix, text", [(".jsonl", TEXT), (".csv", CSV), (".txt", CSV), (".jsonl.gz", TEXT)])
@pytest.mark.parametrize("encoding, mark, named, evidence", WIDE)
def test_a_utf16_or_utf32_file_is_named_with_its_encoding(tmp_path, suffix, text, encoding, mark, named, evidence):
    """Every reader (the record reader and the Arrow one) names the encoding and how it was told, never latin1."""
    data = encoded(text, encoding, mark)
    path = tmp_path / f"data{suffix}"
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    message = (
        rf"^{re.escape(str(path))} is {named} text \({evidence}.*\), not UTF-8\. Convert it: `.*iconv -f {named} "
    )
    with pytest.raises(ValueError, match=message) as error:
        read_records(path)
    assert "latin" not in str(error.value).lower() and "8859" not in str(error.value)
    with pytest.raises(ValueError, match=message):
        load_records(path, ["text"])


@pytest.mark.parametrize("raw, guess", [(TEXT.encode("latin-1"), "CP1252"), (b'{"text": "\x81\xe9"}\n', "ISO-8859-1")])
def test_bytes_that_are_not_utf8_are_named_by_line_with_a_guessed_encoding(tmp_path, raw, guess):
    """Without a byte-order mark or zero bytes, the bytes alone cannot tell the encoding: the error names the line
    and byte, guesses a Western European encoding (one that defines every byte it saw) and says it is a guess."""
    path = tmp_path / "data.jsonl"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=rf"line 1: not valid UTF-8 .* `iconv -f {guess} -t UTF-8 .*a guess") as error:
        read_records(path)
    assert f"file -i {path}" in str(error.value)


@pytest.mark.skipif(shutil.which("iconv") is None, reason="iconv is not installed")
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
@pytest.mark.parametrize(
    "raw", [encoded(TEXT, "utf-16"), encoded(TEXT, "utf-16-be"), encoded(TEXT, "utf-32"), TEXT.encode("cp1252")]
)
def test_the_command_the_error_gives_converts_the_file(tmp_path, suffix, raw):
    """The command in the error, run as given, writes a UTF-8 copy that reads as the text that was written."""
    path = tmp_path / f"my data{suffix}"  # a space: the command quotes its paths
    path.write_bytes(gzip.compress(raw) if suffix.endswith(".gz") else raw)
    with pytest.raises(ValueError) as error:
        read_records(path)
    command = re.search(r"`([^`]*iconv[^`]*)`", str(error.value)).group(1)
    subprocess.run(command, shell=True, check=True, cwd=tmp_path)
    target = shlex.split(command)[-1]
    assert [record["text"] for record in read_records(target)] == ["café au lait", "thé"]


def test_utf8_with_a_nul_escape_or_a_byte_order_mark_still_reads(tmp_path):
    """The check for zero bytes does not take UTF-8 text for UTF-16: a JSON string may hold an escaped NUL, and a
    UTF-8 byte-order mark is dropped as before."""
    path = tmp_path / "data.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + b'{"text": "a\\u0000b"}\n{"text": "' + "thé".encode() + b'"}\n')
    assert [record["text"] for record in read_records(path)] == ["a\x00b", "thé"]
