"""kernels/fp64_reference.py's two kernels under Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported): run by tests/test_fp64_reference.py in a subprocess, the same cases its GPU test runs compiled. The
kernels read codes through a table and compute in fp64 (no fp8 cast, which the interpreter mis-rounds), so the
interpreter runs their arithmetic as the GPU would, up to the order of the sums.
Prints one JSON object: {case: fp64_reference_cases.measure(...)'s numbers}."""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fp64_reference_cases import CASES, measure  # noqa: E402


def main() -> None:
    print(json.dumps({name: measure(device="cpu", **case) for name, case in CASES.items()}))


if __name__ == "__main__":
    main()
