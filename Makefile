# outbox-relay — the two commands: `make demo` and `make test`.
GO       ?= go
PKGS     ?= ./...
# PostgreSQL server binaries: Debian keeps them outside PATH.
PG_BIN   := $(firstword $(dir $(shell command -v initdb 2>/dev/null)) $(wildcard /usr/lib/postgresql/*/bin/))
STATICCHECK := $(shell command -v staticcheck 2>/dev/null || echo $(HOME)/go/bin/staticcheck)

.PHONY: all build test test-group-hogs test-pg17 pg17-root test-short test-deploy helm-rules vet lint demo bench fuzz postgres clean

all: build

build:
	$(GO) build -o bin/outbox-relay ./cmd/outbox-relay

# postgres installs Debian's PostgreSQL server when initdb is missing.
postgres:
	@if [ -z "$(PG_BIN)" ] || [ ! -x "$(PG_BIN)initdb" ]; then \
		echo "initdb not found: installing Debian's postgresql"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	fi

vet:
	$(GO) vet $(PKGS)

lint: vet
	@if [ -x "$(STATICCHECK)" ]; then $(STATICCHECK) $(PKGS); else echo "staticcheck not installed (go install honnef.co/go/tools/cmd/staticcheck@latest): skipped"; fi

# test runs vet and the whole suite with the race detector against a private
# PostgreSQL cluster and an embedded NATS server (see internal/testenv), and
# the Helm chart's checks (test-deploy). The consumer-group tests run after
# the rest, with HOGS CPU-bound busy loops beside them (test-group-hogs):
# their order must hold on a loaded machine, not only on an idle one.
HOGS      ?= 4
GROUP_PKG := ./internal/grouptest/
TEST_PKGS  = $(if $(filter ./...,$(PKGS)),$(shell $(GO) list ./... | grep -v '/internal/grouptest$$'),$(PKGS))
test: postgres vet test-deploy
	$(GO) test -race -count=1 -timeout 25m $(TEST_PKGS)
	@if [ "$(PKGS)" = "./..." ]; then $(MAKE) --no-print-directory test-group-hogs; fi

test-group-hogs: postgres
	scripts/with-hogs.sh $(HOGS) $(GO) test -race -count=1 -timeout 15m $(GROUP_PKG)

# test-pg17 is CI's PostgreSQL 17 lane: every package whose tests talk to
# PostgreSQL, then the PostgreSQL fault tests, against private clusters run
# from a Debian trixie root filesystem (scripts/pg17-root.sh prepares it
# once, at OUTBOX_PG17_ROOT or /var/cache/outbox-relay/pg17-trixie, and
# mounts /proc and /dev in it for the run). Needs root.
PG17_PKGS   ?= ./internal/testenv/ ./replication/ ./relay/ ./consumer/ ./dlq/ ./outbox/ ./sql/ \
	./internal/reconcile/ ./internal/cleanup/ ./internal/failover/ ./cmd/outbox-relay/ ./cmd/reward-consumer/ ./cmd/outbox-demo/
PG17_FAULTS ?= TestPostgresRestart|TestPostgresTLSVerifyFull|TestSlotInvalidatedStatus|TestNetworkFaultsPostgres|TestFailoverSlotNeedsPostgres17|TestLeastPrivilege|TestHATakeover
test-pg17: vet pg17-root
	scripts/pg17-root.sh run $(GO) test -race -count=1 -timeout 20m $(PG17_PKGS)
	scripts/pg17-root.sh run $(GO) test -race -count=1 -timeout 10m -run '^($(PG17_FAULTS))$$' ./internal/faults/

pg17-root:
	scripts/pg17-root.sh prepare

# test-deploy renders the Helm chart (deploy/helm/outbox-relay) with Helm's
# Go library and checks every object; a module of its own (deploy/helmtest),
# so Helm and the Kubernetes types stay out of the relay's go.mod. It also
# exports a trace over OTLP to the OpenTelemetry Collector's receiver
# (deploy/otlptest, a module of its own for the same reason).
test-deploy: postgres
	cd deploy/helmtest && $(GO) vet ./... && $(GO) test -count=1 -timeout 5m ./...
	cd deploy/otlptest && $(GO) vet ./... && $(GO) test -race -count=1 -timeout 5m ./...

# helm-rules copies the alert rules into the chart, which can embed only its
# own files: deploy/prometheus/alerts.yml stays the one source, and
# test-deploy fails when the copy differs.
helm-rules:
	cp deploy/prometheus/alerts.yml deploy/helm/outbox-relay/files/alerts.yml

test-short: vet
	$(GO) test -short -count=1 $(PKGS)

demo: postgres
	$(GO) run ./cmd/outbox-demo

# bench measures the relay against this machine's ceilings (PostgreSQL
# decoding, JetStream storing) in one run and writes bench/results/*.json;
# BENCH_FLAGS=--large adds the 2M-event backlog and the 1M-row transaction.
BENCH_FLAGS ?=
bench: postgres
	$(GO) build -o bin/outbox-relay ./cmd/outbox-relay
	$(GO) build -o bin/outbox-bench ./cmd/outbox-bench
	bin/outbox-bench --relay-bin bin/outbox-relay $(BENCH_FLAGS)

fuzz:
	$(GO) test -run XXX -fuzz FuzzDecode -fuzztime 30s ./replication/internal/pgoutput/
	$(GO) test -run XXX -fuzz FuzzEscapeToken -fuzztime 30s ./router/
	$(GO) test -run XXX -fuzz FuzzRoute -fuzztime 30s ./router/

clean:
	rm -rf bin

# chaos runs the fault suite's long variants (internal/faults with
# OUTBOX_CHAOS=1: outages over 30 s, repeated kills and leader losses,
# larger loads), bounded to 15 minutes, and prints one row per fault:
# events, missing, out of order, duplicates in the stream, slot samples
# ahead of the stream, recovery time. Full output: bin/chaos.log.
.PHONY: chaos
chaos: postgres
	@mkdir -p bin && rm -f bin/chaos-report.txt
	-OUTBOX_CHAOS=1 OUTBOX_CHAOS_REPORT=$(CURDIR)/bin/chaos-report.txt $(GO) test -count=1 -timeout 15m -v ./internal/faults/ 2>&1 \
		| tee bin/chaos.log | grep --line-buffered -E '^ *--- |^(ok|FAIL|panic)'
	@cat bin/chaos-report.txt 2>/dev/null || true
	@grep -q '^ok' bin/chaos.log
