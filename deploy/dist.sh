#!/usr/bin/env bash
# The release artifacts, into dist/ (`make dist` runs this with the
# Makefile's VERSION, LDFLAGS and BENCH_LDFLAGS):
#
#   ringside-VERSION-linux-amd64        the sidecar, CUDA copy backend built in
#   ringside-bench-VERSION-linux-amd64  the benchmarks
#   ringside-PEP440-py3-none-any.whl    the connector (connector/python)
#   SHA256SUMS                          sha256sum -c SHA256SUMS checks them
#
# The binaries are built as deploy/Dockerfile.gpu builds the GPU image's
# (deploy's tests check that both agree): CGO_ENABLED=1, no build tags,
# -trimpath, -ldflags "-s -w" plus the -X that stamps VERSION into
# `ringside version` and `ringside-bench --version`. The CUDA backend is cgo
# that opens libcuda.so.1 with dlopen at run time: no CUDA toolkit here, only
# gcc, and the binary starts on machines without a GPU. It links the build
# machine's glibc dynamically, so it runs on that glibc release or later
# (the GPU image builds on Debian 12, glibc 2.36; the line printed at the
# end says what this build needs).
#
# The wheel's version is VERSION in PEP 440 form (connector/python/setup.py:
# v1.2.3 -> 1.2.3, v1.2.3-4-gabc1234 -> 1.2.3.post4+gabc1234, a history
# without tags abc1234 -> 0+gabc1234, -dirty -> +...dirty). It is built
# without build isolation on $PYTHON's setuptools, pinned in
# connector/python/requirements-test.txt (no index needed), from a copy of
# connector/python, and leaves out the test and benchmark peers
# (connector/python/tests/test_wheel.py checks the contents).
set -euo pipefail
cd "$(dirname "$0")/.."

: "${VERSION:?VERSION is not set (make dist sets it from git describe)}"
: "${LDFLAGS:?LDFLAGS is not set (make dist passes the Makefile ones)}"
: "${BENCH_LDFLAGS:?BENCH_LDFLAGS is not set (make dist passes the Makefile ones)}"
GO=${GO:-go}
PYTHON=${PYTHON:-python3}
out=${DIST:-dist}

case "$VERSION" in
*/* | *' '* | '') echo "dist: VERSION '$VERSION' cannot name a file" >&2; exit 2 ;;
esac
if [ "$("$GO" env GOHOSTOS)/$("$GO" env GOHOSTARCH)" != linux/amd64 ] && [ -z "${CC:-}" ]; then
	echo "dist: the cgo build for linux/amd64 needs a linux/amd64 host, or CC set to a cross compiler for it" >&2
	exit 2
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$out"
mkdir -p "$out"

build() { # build BINARY PACKAGE LDFLAGS
	local bin="$out/$1-$VERSION-linux-amd64"
	CGO_ENABLED=1 GOOS=linux GOARCH=amd64 "$GO" build -trimpath -ldflags "-s -w $3" -o "$bin" "$2"
	if ! "$GO" version -m "$bin" | grep -q 'CGO_ENABLED=1'; then
		echo "dist: $bin was built without cgo: no CUDA backend" >&2
		exit 1
	fi
}
build ringside ./cmd/ringside "$LDFLAGS"
build ringside-bench ./cmd/ringside-bench "$BENCH_LDFLAGS"

# The version each binary reports is VERSION.
got=$("$out/ringside-$VERSION-linux-amd64" version)
[ "$got" = "ringside $VERSION" ] || { echo "dist: ringside version says '$got', want 'ringside $VERSION'" >&2; exit 1; }
got=$("$out/ringside-bench-$VERSION-linux-amd64" --version)
case "$got" in
*" $VERSION") ;;
*) echo "dist: ringside-bench --version says '$got', want VERSION $VERSION" >&2; exit 1 ;;
esac

mkdir "$tmp/src"
cp -R connector/python/pyproject.toml connector/python/setup.py connector/python/LICENSE connector/python/ringside "$tmp/src/"
find "$tmp/src" -name __pycache__ -prune -exec rm -rf {} +
RINGSIDE_VERSION=$VERSION "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --no-index \
	--disable-pip-version-check -w "$out" "$tmp/src"

(cd "$out" && sha256sum -- * >SHA256SUMS && sha256sum --quiet -c SHA256SUMS)

ls -l "$out"
if command -v objdump >/dev/null 2>&1; then
	need=$(objdump -T "$out/ringside-$VERSION-linux-amd64" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
	echo "dist: the binaries need ${need:-no versioned glibc symbols} or later"
fi
