"""Import a standalone script (a benchmark under bench/) as a module, to test
its functions without running it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_script(path: Path, name: str) -> ModuleType:
    """The script at ``path`` as module ``name``, its folder first on the
    import path while it loads, as ``python bench/NAME.py`` has it (the
    benchmarks import bench/_options.py)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module
