"""Text files read as UTF-8 text, line by line, with what goes wrong named: gzip (`*.gz`) un-zipped, a stream cut
short or damaged named with its last line, bytes that are not UTF-8 named with their line and the command that
converts the file (UTF-16 and UTF-32 recognised by their byte-order mark or their zero bytes); and a long text cut
into pieces a tokenizer reads one after another (`split_before_whitespace`)."""

import codecs
import gzip
import io
import shlex
import zlib
from collections.abc import Iterator
from pathlib import Path


def open_text(path: str | Path) -> io.TextIOBase:
    """Open a UTF-8 text file for reading, transparently un-gzipping `*.gz`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file.")
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return path.open(encoding="utf-8", newline="")


def read_lines(path: str | Path) -> Iterator[str]:
    """The lines of a UTF-8 text file (un-gzipping `*.gz`), line endings kept, a leading byte-order mark dropped.

    Lines are decoded one at a time, so bytes that are not UTF-8 are reported with their line, which a text stream
    (decoding blocks of several kilobytes) cannot do. A `*.gz` file that is not gzip, or that ends before its end
    marker (a half-written or cut download), is an error naming the file and the last line read.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file.")
    with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as handle:
        for line_number, raw in enumerate(gzip_lines(handle, path), start=1):
            # UTF-16 or UTF-32 text: its byte-order mark is no UTF-8, and without one, ASCII text is (with zero bytes)
            wide = wide_encoding(raw) if line_number == 1 else None
            if wide is not None:
                encoding, evidence = wide
                raise ValueError(
                    f"{path} is {encoding} text ({evidence}), not UTF-8. Convert it: {conversion(path, encoding)}."
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{path}, line {line_number}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at column "
                    f"{error.start + 1}). Convert the file to UTF-8, e.g. {conversion(path, single_byte_guess(raw))} "
                    f"if it is Western European text (a guess from its bytes; `file -i {shlex.quote(str(path))}` "
                    "names most encodings)."
                ) from None
            if line_number == 1 and line.startswith("\ufeff"):
                line = line[1:]
            yield line


# Byte-order marks of the encodings whose text a UTF-8 reader cannot read, UTF-32's first (UTF-32-LE's starts with
# UTF-16-LE's).
BYTE_ORDER_MARKS = (
    (codecs.BOM_UTF32_LE, "UTF-32LE"),
    (codecs.BOM_UTF32_BE, "UTF-32BE"),
    (codecs.BOM_UTF16_LE, "UTF-16LE"),
    (codecs.BOM_UTF16_BE, "UTF-16BE"),
)


def wide_encoding(start: bytes) -> tuple[str, str] | None:
    """The UTF-16 or UTF-32 encoding that the first line of a file shows, and how: by its byte-order mark (named
    without the byte order, which iconv then reads from the mark and drops) or, without one, by zero bytes beside each
    character of ASCII text. None for text in a byte-wide encoding (UTF-8 among them)."""
    for mark, name in BYTE_ORDER_MARKS:
        if start.startswith(mark):
            return name[:-2], f"its byte-order mark is {name}'s"
    start = start[:4096]
    if len(start) < 4 or start.count(0) < len(start) // 3:
        return None
    for width, order in ((4, "LE"), (4, "BE"), (2, "LE"), (2, "BE")):
        # the bytes of each character but its lowest: zero for ASCII text
        high = [
            start[index : index + width][1:] if order == "LE" else start[index : index + width][:-1]
            for index in range(0, len(start) - width + 1, width)
        ]
        if sum(not any(part) for part in high) >= 0.9 * len(high):
            return f"UTF-{8 * width}{order}", "no byte-order mark, but zero bytes beside each ASCII character"
    return None


def single_byte_guess(raw: bytes) -> str:
    """Windows' Western European encoding for bytes that are not UTF-8, unless they hold a byte it leaves undefined
    (then ISO-8859-1, which defines every byte): the likeliest of the encodings a byte alone cannot tell apart."""
    undefined = {0x81, 0x8D, 0x8F, 0x90, 0x9D}
    return "ISO-8859-1" if undefined & set(raw) else "CP1252"


def conversion(path: Path, encoding: str) -> str:
    """The shell command that writes a UTF-8 copy of `path`, read as `encoding`, beside it."""
    path = Path(path)
    if path.suffix == ".gz":
        target = path.with_name(path.name[: -len(".gz")])
        target = target.with_name(f"{target.stem}.utf8{target.suffix}.gz")
        return (
            f"`gunzip -c {shlex.quote(str(path))} | iconv -f {encoding} -t UTF-8 | gzip > {shlex.quote(str(target))}`"
        )
    target = path.with_name(f"{path.stem}.utf8{path.suffix}")
    return f"`iconv -f {encoding} -t UTF-8 {shlex.quote(str(path))} > {shlex.quote(str(target))}`"


# What reading a gzip file that is cut short (EOFError), not gzip, or damaged raises.
GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


def gzip_lines(handle, path: Path) -> Iterator[bytes]:
    """The lines of an open binary file; for a gzip file, a damaged or cut stream is a `ValueError` naming `path`."""
    lines_read = 0
    try:
        for raw in handle:
            lines_read += 1
            yield raw
    except GZIP_ERRORS as error:
        read = f"after line {lines_read}" if lines_read else "before its first line"
        raise ValueError(
            f"{path}: the gzip stream is damaged or cut short {read} ({error}): a half-written file or an interrupted "
            "download? Check it with `gzip -t`, and write or download it again."
        ) from None


def split_before_whitespace(text: str, characters: int = 1 << 16) -> list[str]:
    """`text` in pieces of at most `characters` characters, each cut just before a whitespace character.

    Reading a long text in pieces bounds what a tokenizer holds: a fast tokenizer keeps some 150 bytes per character
    of a text it reads in one call (a 20 MB line took 3.6 GB). Pre-tokenizers split words at whitespace (WordPiece's,
    and byte-level BPE's, which starts a word with the space before it), so the pieces' tokens, one piece after
    another, are the whole text's. A run of `characters` characters without whitespace is cut where it reaches the
    limit."""
    pieces, start = [], 0
    while len(text) - start > characters:
        end = start + characters
        cut = max(text.rfind(space, start + 1, end + 1) for space in " \t\n\r")
        end = cut if cut > start else end
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces
