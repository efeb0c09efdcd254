#!/usr/bin/env bash
# Fetch the Python sources of the vLLM releases the connector supports that
# cannot be installed here (vLLM 0.33.0 and 0.34.0 have no CPU build on PyPI),
# for the connector's conformance test
# (connector/python/tests/test_vllm_versions.py), which reads them with
# Python's ast module, and runs the connector's unit tests under their
# schedulers. The newest CPU build (vLLM 0.32.0) is the installed engine of
# `make vllm-venv`.
#
#   connector/python/scripts/fetch-vllm-src.sh [DIR]   (default: <repo>/.vllm-src)
#
# Leaves DIR/<version>/vllm/**.py: the .py files of PyPI's `vllm` wheel for
# x86_64 (57 MB of 0.33.0's 336 MB wheel, 63 MB of 0.34.0's 239 MB one),
# checked against the sha256 pinned below; the wheel itself is not kept. Idempotent: a marker file holding the
# pinned hash makes a second run a no-op; a changed pin fetches again.
#
# Env: PYTHON (default python3; only its pip is used, any platform).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
dir="${1:-$repo/.vllm-src}"
py="${PYTHON:-python3}"

# version, sha256 of vllm-<version>-cp38-abi3-manylinux_2_28_x86_64.whl on PyPI
# (as PyPI's simple index lists it)
pins=(
    "0.33.0 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
    "0.34.0 79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2"
)

tmp=""
trap 'if [[ -n "$tmp" ]]; then rm -rf "$tmp"; fi' EXIT

for pin in "${pins[@]}"; do
    read -r version sha <<<"$pin"
    dest="$dir/$version"
    marker="$dest/.ringside-vllm-src"
    if [[ -f "$marker" && "$(cat "$marker")" == "$sha" ]]; then
        echo "fetch-vllm-src: $dest is up to date (vllm $version); nothing to do"
        continue
    fi
    start=$(date +%s)
    tmp="$(mktemp -d)"
    printf 'vllm==%s --hash=sha256:%s\n' "$version" "$sha" >"$tmp/pin.txt"
    echo "fetch-vllm-src: downloading the vllm $version wheel (240 to 340 MB) ..."
    "$py" -m pip download --quiet --disable-pip-version-check --progress-bar off --no-deps \
        --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp \
        --require-hashes -r "$tmp/pin.txt" -d "$tmp/wheel"
    t_dl=$(date +%s)
    rm -rf "$dest"
    "$py" - "$tmp"/wheel/vllm-*.whl "$dest.part" <<'PY'
import shutil, sys, zipfile
wheel, dest = sys.argv[1:]
shutil.rmtree(dest, ignore_errors=True)
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    z.extractall(dest, names)
print("fetch-vllm-src: %d Python files" % len(names))
PY
    mv "$dest.part" "$dest"
    echo "$sha" >"$marker"
    rm -rf "$tmp"
    tmp=""
    end=$(date +%s)
    echo "fetch-vllm-src: vllm $version in $dest in $((end - start))s (download $((t_dl - start))s); size $(du -sh "$dest" | cut -f1)"
done
