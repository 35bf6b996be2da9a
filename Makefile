# stunnerd-xdp: a kernel-bypass TURN data plane. `make help` lists the targets.
GO      ?= go
BIN     ?= bin
# The privileged tests share two cores with their traffic generators: one
# package at a time keeps their measurements honest.
TESTFLAGS ?= -count=1 -p 1 -timeout 40m
# The race detector runs over the tests -short keeps (unprivileged, plus the
# few root ones that drive the daemon without XDP): the control plane's
# goroutines meet there; instrumenting the traffic tests would only slow them.
RACEFLAGS ?= -race -short -count=1 -timeout 20m

.PHONY: help generate check-generate check-repo build tools kube-bins test test-short test-race test-modules test-kernels fuzz-ci vet lint demo bench bench-smoke clean

# golangci-lint is built from the module proxy at this version (go install
# checks it against the checksum database); .golangci.yml configures it.
GOLANGCI_LINT_VERSION ?= v2.15.0
GOLANGCI_LINT         := $(BIN)/golangci-lint-$(GOLANGCI_LINT_VERSION)

# Differential fuzz targets (XDP program vs the Go reference model); CI runs
# each for FUZZTIME as a regression check. Minimizing is kept short: every
# input costs ~100 syscalls.
FUZZ_TARGETS ?= FuzzRelayVsModel FuzzRelayBindingsVsModel FuzzTCVsModel FuzzTCBindingsVsModel FuzzChargeVsModel
FUZZTIME     ?= 30s

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

generate: ## rebuild the BPF object and its Go bindings with clang (bpf2go)
	$(GO) generate ./bpf/...

check-generate: generate ## fail if `make generate` changes a committed file
	@git diff --exit-code -- bpf/ || { echo "bpf/: generated files differ from the committed ones; run make generate and commit"; exit 1; }

# A 49 MB binary was committed twice: no tracked file may exceed MAX_TRACKED_KB
# outside testdata/ (fuzz corpora and captures may be large).
MAX_TRACKED_KB ?= 1024

check-repo: ## fail if a tracked file outside testdata/ is over 1 MB
	@big=$$(git ls-files -z | grep -zv '/testdata/' | xargs -0 -r du -k --apparent-size | awk '$$1 > $(MAX_TRACKED_KB) {print $$2 " (" $$1 " KiB)"}'); \
	if [ -n "$$big" ]; then echo "tracked files over $(MAX_TRACKED_KB) KiB (build outputs belong in .gitignore):"; echo "$$big"; exit 1; fi

# --version prints it; without it the binary reports its VCS revision.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null)

build: ## build bin/stunnerd-xdp (--version prints VERSION: git describe)
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN)/stunnerd-xdp ./cmd/stunnerd-xdp

$(BIN)/turncat $(BIN)/stunnerd $(BIN)/stunnerd-v1.2.1:
	test/tools/build.sh $(BIN)

$(BIN)/udpecho: $(wildcard test/cmd/udpecho/*.go)
	$(GO) build -o $(BIN)/udpecho ./test/cmd/udpecho

# etcd and kube-apiserver for the tests that run against a real API server
# (test/kubeapi), built from test/kapi, a module of its own that keeps
# Kubernetes' server code out of the main module. Cold, kube-apiserver takes
# ~6 min and 1.8 GB; afterwards the Go build cache makes both a relink.
$(BIN)/etcd: test/kapi/go.mod test/kapi/go.sum test/kapi/etcd/main.go
	cd test/kapi && $(GO) build -trimpath -ldflags='-s -w' -o $(abspath $(BIN))/etcd ./etcd

$(BIN)/kube-apiserver: test/kapi/go.mod test/kapi/go.sum
	cd test/kapi && $(GO) build -trimpath -ldflags='-s -w' -o $(abspath $(BIN))/kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver

kube-bins: $(BIN)/etcd $(BIN)/kube-apiserver ## build etcd and kube-apiserver v1.35.4 (test/kapi) into bin/ for the API server tests

tools: $(BIN)/turncat $(BIN)/stunnerd-v1.2.1 $(BIN)/udpecho ## build STUNner v1.1.0's turncat and stunnerd, v1.2.1's stunnerd, and udpecho, into bin/

vet: ## go vet and gofmt
	$(GO) vet ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt: files above need formatting"; exit 1; }

$(GOLANGCI_LINT):
	mkdir -p $(BIN)/.golangci-lint
	GOBIN=$(abspath $(BIN))/.golangci-lint $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)
	mv $(BIN)/.golangci-lint/golangci-lint $@

lint: vet $(GOLANGCI_LINT) ## vet, then golangci-lint (.golangci.yml); the first run builds golangci-lint into bin/
	$(GOLANGCI_LINT) run ./...

test: vet tools kube-bins test-race test-modules ## run every test; as root the XDP and network-namespace tests run too
	$(GO) test $(TESTFLAGS) ./...

# Test modules of their own, keeping their dependencies out of the main module:
# test/stunner runs the binary as a STUNner dataplane against STUNner's config discovery server (root;
# STUNner brings pion/turn v5); test/deploy renders deploy/ with kustomize.
TEST_MODULES ?= test/stunner test/deploy

test-modules: ## vet and run the test modules under test/ that build against STUNner itself
	@for m in $(TEST_MODULES); do \
		echo "test module $$m"; \
		(cd $$m && $(GO) vet ./... && $(GO) test $(TESTFLAGS) ./...) || exit 1; \
	done

# The kernels Kubernetes nodes run, booted under qemu (TCG): Debian's 5.10,
# 6.1 and 6.12 (test/kernels, docs/testing.md says what runs where).
KERNELS ?= bullseye bookworm trixie
# The kernels whose node shapes also run their --xdp-mode=off twins ("all", or
# a list; the others run the default mode): CI runs them on bookworm only.
KERNELS_TWINS ?= all

test-kernels: tools ## (root) boot Debian's 5.10, 6.1 and 6.12 kernels under qemu and run the kernel-facing tests in each (KERNELS=...)
	GO=$(GO) BIN=$(BIN) KERNELS_TWINS='$(KERNELS_TWINS)' test/kernels/matrix.sh $(KERNELS)

test-race: ## the -short tests under the race detector
	$(GO) test $(RACEFLAGS) ./...

fuzz-ci: ## (root) run each differential fuzz target for FUZZTIME
	@for f in $(FUZZ_TARGETS); do \
		echo "fuzz $$f for $(FUZZTIME)"; \
		$(GO) test ./bpf -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) -fuzzminimizetime 3s || exit 1; \
	done

test-short: ## the unprivileged tests only
	$(GO) test -short -count=1 ./...
	@for m in $(TEST_MODULES); do (cd $$m && $(GO) test -short -count=1 ./...) || exit 1; done

bench: tools $(BIN)/stunnerd $(BIN)/stunnerd-v1.2.1 ## (root) stunnerd-xdp vs its userspace path, STUNner stunnerd and coturn; writes bench/out/report.md
	BENCH=full $(GO) test ./bench -run '^TestBench$$' -v -count=1 -timeout 50m

bench-smoke: tools $(BIN)/stunnerd $(BIN)/stunnerd-v1.2.1 ## (root) a tiny run of every benchmark stage (~1 min); fails if a report row is missing
	BENCH=smoke $(GO) test ./bench -run '^TestBench$$' -v -count=1 -timeout 10m

demo: build tools ## (root) relay iperf through turncat and stunnerd-xdp with XDP in network namespaces
	$(GO) run ./test/demo --daemon $(BIN)/stunnerd-xdp --turncat $(BIN)/turncat

clean: ## remove build output
	rm -rf $(BIN)
