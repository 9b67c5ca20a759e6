"""Peak extra disk while a GGUF's first load writes its prepared file into a fresh cache folder: the spill file
punched as it is read back (models/safetensors.py `punch_hole`, the default) or kept whole until written
(`--no-punch`). The filesystem's used bytes are sampled every 10 ms; run it on a quiet disk (another writer moves
the figure).

    python scripts/spill_disk_peak.py ~/.cache/draftwise/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    python scripts/spill_disk_peak.py ~/.cache/draftwise/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --no-punch

A script, not part of the package (nothing under draftwise/ imports it).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time

from draftwise.api import load_model
from draftwise.models import safetensors as st


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a .gguf file (or a packaged model's name)")
    ap.add_argument("--no-punch", action="store_true", help="keep the spill whole until the file is written")
    ap.add_argument("--dir", default=None, help="where the fresh cache folder goes (default: the temp folder)")
    args = ap.parse_args()
    if args.no_punch:
        st.punch_hole = lambda fd, at, size: False
    cache = tempfile.mkdtemp(prefix="spill-peak-", dir=args.dir)
    base = shutil.disk_usage(cache).used
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], shutil.disk_usage(cache).used - base)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        t = time.perf_counter()
        load_model(args.model, weights="auto", cache_dir=cache)
        load_s = time.perf_counter() - t
        done.set()
        watcher.join()
        kept = shutil.disk_usage(cache).used - base
    finally:
        done.set()
        shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({"model": args.model, "punch": not args.no_punch, "peak_extra_GB": round(peak[0] / 1e9, 3),
                      "kept_GB": round(kept / 1e9, 3), "load_s": round(load_s, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
