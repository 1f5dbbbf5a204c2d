"""Import Transformers' own common model tests from the sdist of the installed Transformers version.

The `tests/` folder is not part of the Transformers wheel, so the sdist of the installed version is downloaded once
with pip into a cache directory outside the repository (`$RAN_HF_CACHE`, default `~/.cache/ran_hf`), extracted there,
and its test modules are imported as the package `transformers_sdist_tests`. Where the package registry cannot be
reached, `SdistUnavailable` says so and `test_conformance.py` skips with that reason. The few modules they import that
the sdist does not ship (generation and export mixins, the shared config kwargs) are replaced by small stand-ins.
"""

import importlib
import os
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
        """Stand-in for `tests/generation/test_utils.py`: no generation tests."""

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


def load_common_tests():
    """(test_modeling_common, test_configuration_common) modules of the installed Transformers version."""
    if PACKAGE not in sys.modules:
        tests_dir = sdist_tests_dir()
        package = _install_module(PACKAGE, __file__=str(tests_dir / "__init__.py"))
        package.__path__ = [str(tests_dir)]
        _install_stand_ins()
    return (
        importlib.import_module(f"{PACKAGE}.test_modeling_common"),
        importlib.import_module(f"{PACKAGE}.test_configuration_common"),
    )
