"""Print the text the bundled model's fitted predictors of use are fitted on (docs/benchmarks.md,
"A fitted predictor"): the standard library's top-level modules whose opening is not in the
model's held-out text, in name order. Run from the repository root:
`python docs/traces/stdlib_fit_text.py > /tmp/fit-stdlib-all.txt`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from predictor_variants import HELDOUT, stdlib_text  # noqa: E402

with open(HELDOUT) as f:
    sys.stdout.write(stdlib_text(f.read()))
