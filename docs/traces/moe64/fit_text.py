"""Print the text the second model's predictor was fitted on: its training files (manifest split
`train`) in the order of their sha256, until 400 KB. Usage: `python docs/traces/moe64/fit_text.py
SITE_PACKAGES > fit.txt` (the directory the manifest's paths are relative to)."""

import json
import sys
from pathlib import Path

root = Path(sys.argv[1])
manifest = json.loads((Path(__file__).parent / "manifest.json").read_text())
total, parts = 0, []
for entry in sorted((e for e in manifest["files"] if e["split"] == "train"), key=lambda e: e["sha256"]):
    parts.append((root / entry["path"]).read_text(encoding="utf-8"))
    total += entry["size"]
    if total > 400_000:
        break
sys.stdout.write("\n\n".join(parts))
