#!/usr/bin/env bash
# Install FlashInfer from the wheelhouse of flashinfer_wheelhouse.py, without network, into a
# target folder (the device's own packages untouched): flashinfer-python, apache-tvm-ffi and
# nvidia-ml-py always, requests / tqdm / packaging / ml_dtypes only where the device's Python
# lacks them (ninja where no `ninja` is on PATH). Then: export PYTHONPATH=$PYTHONPATH:DEST
# (appended: the device's packages win) and PATH=$PATH:DEST/bin.
# Usage: bash benches/attention/install_flashinfer.sh [WHEELHOUSE=.whl] [DEST=/tmp/flashinfer]
set -eu
WH=${1:-.whl}
DEST=${2:-/tmp/flashinfer}
PY=${PYTHON:-python3}
want="flashinfer_python apache_tvm_ffi nvidia_ml_py"
for m in requests:requests tqdm:tqdm packaging:packaging ml_dtypes:ml_dtypes; do
  $PY -c "import ${m%%:*}" 2>/dev/null || want="$want ${m#*:}"
done
$PY -c "import requests" 2>/dev/null || want="$want certifi charset_normalizer idna urllib3"
command -v ninja >/dev/null || want="$want ninja"  # the JIT runs `ninja`: then PATH=DEST/bin:$PATH
files=""
for w in $want; do files="$files $(ls "$WH"/${w}-*.whl)"; done
$PY -m pip install --no-index --no-deps --target "$DEST" $files
echo "installed into $DEST: $want"
PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$DEST $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
