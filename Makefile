# make bench        the benchmarks (as root; about fifteen minutes); writes BENCHMARKS.md
# make bench-quick  small sizes and 3 rounds; writes bin/BENCHMARKS-quick.md
# make bench-sim    the cluster simulation alone (a few minutes); prints its table, writes bin/BENCHMARKS-sim.md
# make test         scripts/test.sh: gofmt, go vet, every test
# make oracle SEED=N OPS=M   the POSIX oracle against tmpfs: one sequence of M operations (as root)
GO ?= go
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: bench bench-quick bench-sim test oracle

bench:
	$(GO) build -o bin/bench ./bench
	$(SUDO) env "PATH=$$PATH" bin/bench -out BENCHMARKS.md

bench-quick:
	$(GO) build -o bin/bench ./bench
	$(SUDO) env "PATH=$$PATH" bin/bench -quick -out bin/BENCHMARKS-quick.md

bench-sim:
	$(GO) build -o bin/bench ./bench
	$(SUDO) env "PATH=$$PATH" bin/bench -groups sim -out bin/BENCHMARKS-sim.md

test:
	./scripts/test.sh

SEED ?= 1
OPS ?= 100000
oracle:
	$(SUDO) env "PATH=$$PATH" TENSORFS_STRICT=1 TENSORFS_ORACLE_SEED=$(SEED) TENSORFS_ORACLE_OPS=$(OPS) \
		$(GO) test -count=1 -timeout 0 -run 'TestPosixOracle$$' -v ./integration/
