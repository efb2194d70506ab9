"""What weight alignment costs at load: the default model from its aligned conversion
against the same weights written by `safetensors`' own writer (tensors at 8-byte
boundaries, as a user's own model directory usually has them), whose weights `load_model`
then copies to 64-byte boundaries (`models/kernels/aligned.py`).

Each load runs in a fresh process, the two files in turn, `--rounds` times; printed per
load: seconds in `load_model`, the tensors `align_model` copied, peak RSS.

    python bench/aligned_load.py --dtype bfloat16 --quantize none --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_ONE_LOAD = """
import json, resource, sys, time
from aici_cli.models import load
from aici_cli.models.kernels import aligned
counted = []
real = aligned.align_model
load.align_model = lambda model: counted.append(real(model)) or counted[-1]
started = time.perf_counter()
load.load_model(sys.argv[1], "cpu", sys.argv[2], sys.argv[3])
print(json.dumps({"load_s": round(time.perf_counter() - started, 3), "copied": counted[-1],
                  "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
"""


def copies(out: Path) -> tuple[Path, Path]:
    """The default model's conversion as it is (aligned), and rewritten by safetensors."""
    from safetensors.torch import load_file, save_file

    from aici_cli.models.cache.conversions import ensure_dense
    from aici_cli.models.kernels.aligned import without_padding
    from aici_cli.models.sources.resolve import resolve_with_name

    entry = resolve_with_name(None)[0]
    ensure_dense(entry)  # the bf16 copy of every weight, made on the first run that reads it
    ours, theirs = out / "aligned", out / "safetensors-writer"
    for target in (ours, theirs):
        target.mkdir()
        for file in entry.iterdir():
            if file.suffix in (".json", ".jinja"):
                shutil.copy(file, target / file.name)
    shutil.copy(entry / "model.safetensors", ours / "model.safetensors")
    tensors = without_padding(load_file(str(entry / "model.safetensors")))
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(theirs / "model.safetensors"), metadata={"format": "pt"})
    return ours, theirs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize", default="none")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    env = {"AICI_BATCH_KERNEL_PROBE": "off"}  # the load alone
    with tempfile.TemporaryDirectory() as tmp:
        paths = copies(Path(tmp))
        for _ in range(args.rounds):
            for path in paths:
                ran = subprocess.run(
                    [sys.executable, "-c", _ONE_LOAD, str(path), args.dtype, args.quantize],
                    capture_output=True, text=True, check=True,
                    env={**os.environ, **env})
                figures = json.loads(ran.stdout.strip().splitlines()[-1])
                print(f"{path.name:<20} {args.dtype}+{args.quantize}  load "
                      f"{figures['load_s']:.2f} s  copied {figures['copied']:>4}  "
                      f"peak RSS {figures['peak_rss_mb']} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
