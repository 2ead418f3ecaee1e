"""`python -m benchmarks.with_constants CONSTANTS ARGS...`: the `kbmesh` command (`ARGS`) with
module constants set first, for benchmarks that study a value the product fixes (ranking,
batch sizes). `CONSTANTS` is JSON: {"services.search.service.RRF_K": 20, ...}; each must
name a constant the module already has."""

from __future__ import annotations

import importlib
import json
import sys


def apply(constants: dict[str, object]) -> None:
    for target, value in constants.items():
        module_name, _, name = target.rpartition(".")
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            raise SystemExit(f"{target}: {module_name} has no constant {name}")
        setattr(module, name, value)


if __name__ == "__main__":
    apply(json.loads(sys.argv[1]))
    from services.cli.commands import main

    main(sys.argv[2:])
