"""The suite's markers hold: every test that reads the shared benchmark data says so, so a clone without the data
skips it (with a reason naming the sets) instead of failing."""

from types import SimpleNamespace

from conftest import DATA_DIR


# Fixtures that read ../shared/data (directly or through a tokenizer trained on it).
DATA_FIXTURES = {"data_dir", "wordpiece_tokenizer", "wordpiece_tokenizer_dir"}
# Module-level names that tests use for the data folder.
DATA_NAMES = {"DATA_DIR", "DATA"}


def reads_shared_data(item) -> str | None:
    """Why `item` reads the shared data, or None."""
    fixtures = DATA_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if fixtures:
        return f"uses the fixture {min(fixtures)}"
    function = getattr(item, "function", None)
    code = getattr(function, "__code__", None)
    if code is not None:
        names = DATA_NAMES.intersection(code.co_names)
        if names and getattr(function, "__globals__", {}).get(min(names)) == DATA_DIR:
            return f"reads {min(names)}"
    return None


def test_every_test_that_reads_the_shared_data_is_marked(request):
    unmarked = [
        f"{item.nodeid}: {why}"
        for item in request.session.items
        if (why := reads_shared_data(item)) and item.get_closest_marker("needs_data") is None
    ]
    assert not unmarked, "mark these @pytest.mark.needs_data(...):\n" + "\n".join(unmarked)


def test_the_check_sees_fixtures_and_the_data_folder():
    def reads_the_folder():
        return DATA_DIR / "wikitext-2"

    def reads_nothing():
        return "wikitext-2"

    assert reads_shared_data(SimpleNamespace(fixturenames=["tmp_path", "wordpiece_tokenizer"], function=reads_nothing))
    assert reads_shared_data(SimpleNamespace(fixturenames=[], function=reads_the_folder)) == "reads DATA_DIR"
    assert reads_shared_data(SimpleNamespace(fixturenames=["tmp_path"], function=reads_nothing)) is None
