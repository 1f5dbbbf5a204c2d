"""Import Transformers' own common model tests from the sdist of the installed Transformers version.

The `tests/` folder is not part of the Transformers wheel, so the sdist of the installed version is downloaded once
with pip into a cache directory outside the repository (`$RAN_HF_CACHE`, default `~/.cache/ran_hf`), extracted there,
and its test modules are imported as the package `transformers_sdist_tests`. Where the package registry cannot be
reached, `SdistUnavailable` says so and `test_conformance.py` skips with that reason. The few modules they import that
the sdist does not ship (generation and export mixins, the shared config kwargs) are replaced by small stand-ins.

The sdist has no `tests/generation/`, so Transformers' generation tests (`GenerationTesterMixin`) come from a source
checkout of Transformers when one is given (`pytest --transformers-tests=<checkout>`): its `tests/generation/` is
imported from there in place of the stand-in, with the `tests.exporters` it imports. The checkout's version is read
from its `src/transformers/__init__.py` and compared with the installed one.
"""

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import transformers


PACKAGE = "transformers_sdist_tests"
REQUIRED_FILES = ("__init__.py", "test_modeling_common.py", "test_configuration_common.py")

# Non-default values for the attributes every `PreTrainedConfig` accepts; `ConfigTester` checks that they stick.
CONFIG_COMMON_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}


NO_GENERATION_TESTS = (
    "Transformers' generation tests are not in its sdist; pass --transformers-tests=<checkout of "
    f"v{transformers.__version__}> to run them"
)


class SdistUnavailable(RuntimeError):
    """The sdist is neither cached nor downloadable (no registry, no network)."""


def cache_dir() -> Path:
    return Path(os.environ.get("RAN_HF_CACHE", "~/.cache/ran_hf")).expanduser()


def sdist_tests_dir(version: str = transformers.__version__) -> Path:
    """The extracted `tests/` folder of the Transformers `version` sdist, downloaded and extracted on first use."""
    root = cache_dir() / f"transformers-{version}-sdist"
    tests_dir = root / f"transformers-{version}" / "tests"
    if all((tests_dir / name).is_file() for name in REQUIRED_FILES):
        return tests_dir

    cache_dir().mkdir(parents=True, exist_ok=True)
    # Download and extract next to the final folder, then move it into place, so that concurrent runs never see a
    # half-extracted tree.
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".transformers-sdist-") as staging:
        download_dir, extracted = Path(staging) / "download", Path(staging) / "extracted"
        pip_download = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--retries", "1"]
        command = [*pip_download, "--timeout", "30", f"transformers=={version}", "-d", str(download_dir)]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired as error:
            raise SdistUnavailable(f"Downloading the Transformers {version} sdist timed out: {command}") from error
        archive_path = download_dir / f"transformers-{version}.tar.gz"
        if result.returncode != 0 or not archive_path.is_file():
            raise SdistUnavailable(
                f"Could not download the Transformers {version} sdist, which holds the common model tests that "
                f"tests/test_conformance.py runs.\nCommand: {' '.join(command)}\n"
                f"Exit code {result.returncode}.\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
            )
        with tarfile.open(archive_path) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(f"transformers-{version}/tests/")]
            archive.extractall(extracted, members=members, filter="data")
        # The tests import each other relatively and locate themselves through `tests/__init__.py`.
        (extracted / f"transformers-{version}" / "tests" / "__init__.py").touch()
        shutil.copy2(archive_path, extracted)
        try:
            extracted.rename(root)
        except OSError:
            if not root.is_dir():  # anything but another run having finished first is a real error
                raise

    if not all((tests_dir / name).is_file() for name in REQUIRED_FILES):
        raise RuntimeError(
            f"The Transformers {version} sdist cached in {root} lacks one of {REQUIRED_FILES}: delete that folder "
            "to download it again."
        )
    return tests_dir


def _install_module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so that stand-ins can nest
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def _install_stand_ins() -> None:
    """Minimal replacements for the modules that the common tests import but the sdist does not ship."""

    class ExportTesterMixin:
        """Stand-in for `tests/exporters/test_export.py`: no export tests."""

    class GenerationTesterMixin:
        """Stand-in for `tests/generation/test_utils.py`: one test, which says where the generation tests are."""

        def test_transformers_generation_tests(self):
            self.skipTest(NO_GENERATION_TESTS)

    stand_ins = {
        "utils": {},
        "utils.test_configuration_utils": {"config_common_kwargs": CONFIG_COMMON_KWARGS},
        "exporters": {},
        "exporters.test_export": {"ExportTesterMixin": ExportTesterMixin},
        "generation": {},
        "generation.test_utils": {"GenerationTesterMixin": GenerationTesterMixin},
    }
    for name, attributes in stand_ins.items():
        _install_module(f"{PACKAGE}.{name}", **attributes)


class TransformersCheckout:
    """A Transformers source tree that holds the tests the sdist lacks (`tests/generation/`, `tests/exporters/`)."""

    def __init__(self, path):
        self.path = Path(path).expanduser().resolve()
        self.tests_dir = self.path / "tests"
        missing = [
            name
            for name in ("__init__.py", "generation/test_utils.py", "exporters/test_export.py")
            if not (self.tests_dir / name).is_file()
        ]
        if missing:
            raise ValueError(
                f"--transformers-tests={path} is not a Transformers source checkout: tests/{', tests/'.join(missing)} "
                "not found there"
            )
        init = self.path / "src" / "transformers" / "__init__.py"
        text = init.read_text(encoding="utf-8") if init.is_file() else ""
        found = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
        self.version = found.group(1) if found else None

    @property
    def matches_installed(self) -> bool:
        return self.version == transformers.__version__

    def describe(self) -> str:
        """One line for the test report: where the generation tests come from, and whether the versions agree."""
        if self.matches_installed:
            return f"Transformers generation tests from {self.path} (version {self.version}, as installed)"
        version = self.version or "unknown (no src/transformers/__init__.py)"
        return (
            f"Transformers generation tests from {self.path}: version {version}, NOT the installed "
            f"{transformers.__version__}; they may test what the installed version does differently"
        )

    def install(self) -> None:
        """Import the checkout's `tests` package (the name its generation tests import it by) and put its generation
        tests where the common tests look for them. The export tests stay stand-ins for `ModelTesterMixin`; the
        generation mixin brings its own (`ExportGenerateTesterMixin`) along."""
        existing = sys.modules.get("tests")
        if existing is not None and Path(getattr(existing, "__file__", "") or "").parent != self.tests_dir:
            raise RuntimeError(
                f"A module named `tests` is already imported ({existing!r}): the generation tests of {self.path} "
                "import their own `tests` package under that name"
            )
        spec = importlib.util.spec_from_file_location(
            "tests", self.tests_dir / "__init__.py", submodule_search_locations=[str(self.tests_dir)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules["tests"] = package
        spec.loader.exec_module(package)
        for name in ("generation", "generation.test_utils"):
            sys.modules[f"{PACKAGE}.{name}"] = importlib.import_module(f"tests.{name}")


def load_common_tests(checkout: TransformersCheckout | None = None):
    """(test_modeling_common, test_configuration_common) modules of the installed Transformers version, with the
    generation tests of `checkout` when one is given (stand-ins otherwise)."""
    if PACKAGE not in sys.modules:
        tests_dir = sdist_tests_dir()
        package = _install_module(PACKAGE, __file__=str(tests_dir / "__init__.py"))
        package.__path__ = [str(tests_dir)]
        _install_stand_ins()
        if checkout is not None:
            checkout.install()
    return (
        importlib.import_module(f"{PACKAGE}.test_modeling_common"),
        importlib.import_module(f"{PACKAGE}.test_configuration_common"),
    )
