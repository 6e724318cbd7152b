# make bench        the benchmarks (as root; about fifteen minutes); writes BENCHMARKS.md
# make bench-quick  small sizes and 3 rounds; writes bin/BENCHMARKS-quick.md
# make test         scripts/test.sh: gofmt, go vet, every test
GO ?= go
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: bench bench-quick test

bench:
	$(GO) build -o bin/bench ./bench
	$(SUDO) env "PATH=$$PATH" bin/bench -out BENCHMARKS.md

bench-quick:
	$(GO) build -o bin/bench ./bench
	$(SUDO) env "PATH=$$PATH" bin/bench -quick -out bin/BENCHMARKS-quick.md

test:
	./scripts/test.sh
