"""`draftwise memory --rss` (bench/memory.py predict_peak_rss): the prediction of one run's peak RSS — a runtime
baseline measured once in a child process and cached, each model's resident weights from its prepared file (an
embedding table of its own counted by the rows a run looks up), K/V blocks for its tokens, one prefill chunk —
is held within 10% of the peak RSS measured (VmHWM) of a child process that runs `draftwise generate` for one
64-token answer on the packaged 1.5B, alone and with the 0.5B draft (a second run: the first prepares the files,
which the prediction does not cover). Unit parts on a tiny GGUF: the resident
weights are the loaded model's mapped bytes, and a cached baseline is not measured again. Integration part:
about 90 s (two calibration children and four generate children); unit part about 10 s."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftwise.bench import memory

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import atexit, sys
def peak():
    hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
    print("VMHWM", int(hwm.split()[1]) * 1024, file=sys.stderr, flush=True)
atexit.register(peak)
from draftwise.cli import main
sys.exit(main(sys.argv[1:]))
"""


def measured_generate(argv: list[str]) -> tuple[int, dict]:
    """(peak RSS bytes, generate --json output) of `draftwise generate argv` in a fresh child process."""
    out = subprocess.run([sys.executable, "-c", _CHILD, "generate", *argv, "--json"], capture_output=True, text=True,
                         cwd=ROOT, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    hwm = int(next(line for line in out.stderr.splitlines() if line.startswith("VMHWM")).split()[1])
    return hwm, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.parametrize("draft", [None, "qwen2.5-coder-0.5b-instruct"])
def test_predicted_peak_rss_within_10_percent_of_measured(draft):
    from tests.conftest import require_packaged

    target = "qwen2.5-coder-1.5b-instruct"
    for name in (target, draft) if draft else (target,):
        require_packaged(name)
    argv = ["--model", target, "--prompt", "Write a palindrome check in Python", "--max-tokens", "64",
            "--ignore-eos"]
    if draft:
        argv += ["--speculative-config", json.dumps({"method": "draft_model", "model": draft,
                                                     "num_speculative_tokens": 4})]
    measured_generate(argv)  # the first load prepares each plan's file (and may tune a draft's plan): not measured
    peak, out = measured_generate(argv)
    predicted = memory.predict_peak_rss(target, draft, prompt_tokens=out["num_prompt_tokens"], max_tokens=64, k=4)
    assert out["num_output_tokens"] == 64
    ratio = predicted["peak_rss_bytes"] / peak
    assert 0.9 <= ratio <= 1.1, (ratio, peak, predicted["bytes"])


def test_resident_weights_are_the_loaded_models_mapped_bytes(tiny_q4k_gguf, tmp_path):
    from draftwise.api import load_model
    from draftwise.models.safetensors import mapped_file

    cache = str(tmp_path / "cache")
    load_model(str(tiny_q4k_gguf), weights="q4x8", cache_dir=cache)  # prepares the file
    model, _, _ = load_model(str(tiny_q4k_gguf), weights="q4x8", cache_dir=cache)
    seen, mapped = set(), 0
    for b in list(model.buffers()) + list(model.parameters()):
        if mapped_file(b) is None or b.data_ptr() in seen:
            continue
        seen.add(b.data_ptr())
        mapped += b.numel() * b.element_size()
    embed = sum(b.numel() * b.element_size() for b in model.model.embed_tokens.buffers())
    assert embed > 0
    resident, info = memory.resident_weight_bytes(str(tiny_q4k_gguf), "q4x8", cache_dir=cache, tokens=0)
    assert info["plan"] == "q4x8" and info["table_bytes"] == embed
    assert resident == mapped - embed  # every other mapped byte is read at each step; no row looked up yet
    some, _ = memory.resident_weight_bytes(str(tiny_q4k_gguf), "q4x8", cache_dir=cache, tokens=1)
    assert resident < some <= resident + embed


def test_runtime_baseline_is_measured_once_and_cached(tiny_q4k_gguf, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    first = memory.runtime_baseline(str(tiny_q4k_gguf), cache_dir=cache)
    assert first["bytes"] > 100 * 2**20  # python + torch at least: a real process was measured
    stored = json.loads((tmp_path / "cache" / memory.BASELINE_FILE).read_text())
    assert stored[first["key"]]["bytes"] == first["bytes"]
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("measured again"))
    assert memory.runtime_baseline(str(tiny_q4k_gguf), cache_dir=cache) == first
    other = memory._machine_key({"target": "x", "version": 1})
    assert other != first["key"]


@pytest.fixture(scope="module")
def tiny_q4k_gguf(tmp_path_factory):
    from tests.tiny_checkpoints import Q4K_DIMS, write_tiny_gguf

    path = tmp_path_factory.mktemp("rss") / "tiny-q4k.gguf"
    write_tiny_gguf(path, "qwen2", dims=Q4K_DIMS, q4k=("_proj.weight", "embed_tokens.weight"))
    return path
