#!/usr/bin/env bash
# Install Dynamo's standalone KV indexer (PyPI `ai-dynamo` 1.6.1 and
# `ai-dynamo-runtime` 1.6.1) into a private venv, from PyPI alone, for the
# opt-in test of the sidecar's tier in vLLM's event stream against a router
# the project did not write (`make test-dynamo`).
#
#   connector/python/scripts/install-dynamo.sh [VENV_DIR]   (default: <repo>/.venv-dynamo)
#
# Idempotent: a marker file with the versions makes a second run a no-op.
#
# Why it is done this way: ai-dynamo 1.6.1 requires `aisimulate`, a placeholder
# package whose install downloads the real wheel from NVIDIA's own index, which
# this workplace cannot reach (the install fails: "The installation of
# aisimulate for version 0.13.0 failed"). The indexer (`python -m
# dynamo.indexer`, Rust in ai-dynamo-runtime's extension) does not import it,
# so ai-dynamo is installed with --no-deps on top of ai-dynamo-runtime and its
# dependencies. It runs on CPU (no CUDA is touched). About 300 MB.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
venv="${1:-$repo/.venv-dynamo}"
py="${PYTHON:-python3}"
version="1.6.1"
marker="$venv/.ringside-dynamo-installed"

if [[ -f "$marker" && "$(cat "$marker")" == "$version" ]]; then
    echo "install-dynamo: $venv is up to date (ai-dynamo $version); nothing to do"
    exit 0
fi
rm -f "$marker"
"$py" -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "ai-dynamo-runtime==$version"
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "ai-dynamo==$version"
"$venv/bin/python" -m dynamo.indexer --help >/dev/null
echo "$version" > "$marker"
echo "install-dynamo: ai-dynamo $version in $venv"
