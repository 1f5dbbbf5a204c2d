"""Run a test script in a fresh interpreter where `ran_hf` cannot be imported, as a user of a saved folder would.

`ran_hf` is made unimportable by a meta-path finder placed before every other one (it wins over the editable install's
path entry and over a regular install alike). The script fills a dict named `report`; `run_without_ran_hf` returns it
after checking that `ran_hf` really was blocked and never imported.
"""

import json
import os
import subprocess
import sys


# Runs before the test's script: blocks `ran_hf` and starts the report.
BLOCK_RAN_HF = r"""
import importlib.abc
import json
import sys

class BlockRanHf(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ran_hf" or name.startswith("ran_hf."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, BlockRanHf())
report = {}
try:
    import ran_hf
except ImportError as error:
    report["import_error"] = str(error)
"""

# Runs after it: prints the report as the last line of output.
PRINT_REPORT = r"""
report["ran_hf_imported"] = any(name == "ran_hf" or name.startswith("ran_hf.") for name in sys.modules)
print(json.dumps(report))
"""


def run_without_ran_hf(script: str, args, tmp_path, timeout: int = 300) -> dict:
    """Run `script` with `args` (`sys.argv[1:]`) where `ran_hf` is unimportable; return the `report` it filled."""
    script_file = tmp_path / "run_without_ran_hf.py"
    script_file.write_text(BLOCK_RAN_HF + script + PRINT_REPORT)
    workdir = tmp_path / "workdir"
    workdir.mkdir(exist_ok=True)
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_MODULES_CACHE=str(tmp_path / "modules"),  # a fresh copy of the remote code, never a stale one
        OMP_NUM_THREADS="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    # -I: no PYTHONPATH, no user site-packages and neither the script's folder nor the working directory on sys.path.
    completed = subprocess.run(
        [sys.executable, "-I", str(script_file), *map(str, args)],
        cwd=workdir,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert "ran_hf" in report.get("import_error", ""), "ran_hf must not be importable in the subprocess"
    assert not report["ran_hf_imported"], "the subprocess imported ran_hf"
    return report
