package main

import (
	"bufio"
	"cmp"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// table is one table of the report: metrics as rows, contenders as
// columns, then ratio columns.
type table struct {
	title   string
	metrics []metricDef
	cols    []string
	ratios  [][2]string // contender, reference
}

func (b *bench) tables() []table {
	return []table{
		{"Data path", []metricDef{mSeqWrite, mSeqRead, mRandIOPS, mRandLat, mRandP99, mMmapCold, mMmapWarm, mMmapSet, mOpenBig, mOpenSmall},
			[]string{tmpfsName, ptName, classicName}, [][2]string{{ptName, tmpfsName}, {classicName, tmpfsName}}},
		{"Metadata", []metricDef{mCreate, mOpen, mStat, mSetxattr, mGetxattr, mReaddir},
			[]string{tmpfsName, ptName, classicName, loopName},
			[][2]string{{ptName, tmpfsName}, {classicName, tmpfsName}, {loopName, tmpfsName}, {ptName, loopName}}},
		{"Scale (one sample each)", []metricDef{mRSSDir, mPeakDir, mHeapDir, mRSSEmpty, mRSSData},
			[]string{ptName, classicName, loopName}, nil},
		{"PyTorch", []metricDef{mTorchReady, mTorchMem, mTorchCopies},
			[]string{ptName, classicName, shmName, copyName}, [][2]string{{ptName, shmName}}},
		{fmt.Sprintf("Reference counts with %d processes mapping %d segments each", holderProcs, holderMappings),
			[]metricDef{mRefcountScan, mHoldersScan, mRefcountCached}, []string{ptName, classicName}, nil},
	}
}

// report renders BENCHMARKS.md.
func (b *bench) report() string {
	var w strings.Builder
	cfg := b.cfg
	fmt.Fprintf(&w, "# tensorfs benchmarks\n\n")
	fmt.Fprintf(&w, "Written by `bench/` (regenerate with `make bench`; `make bench-quick` for a smoke run). "+
		"Every case runs against each contender in every round, the contenders' order rotating from round to "+
		"round, on a shared and noisy machine: cells are the median of %d rounds, with the minimum–maximum in "+
		"brackets.\n\n", cfg.rounds)
	fmt.Fprintf(&w, "- Command: `%s`\n", command())
	fmt.Fprintf(&w, "- Date: %s, run time %s\n", time.Now().UTC().Format("2006-01-02 15:04 MST"), b.elapsed.Round(time.Second))
	fmt.Fprintf(&w, "- Machine: %s\n", machine())
	torch := cmp.Or(b.torchVersion, "not run")
	fmt.Fprintf(&w, "- Kernel: %s; %s; %s; torch %s; tensorfs %s\n", kernel(), runtime.Version(), firstLine("fio", "--version"), torch, b.version)
	fmt.Fprintf(&w, "- Sizes: fio file %s, random reads %s per run; mmap and open() segment %s; metadata loops %d ops; "+
		"readdir directory %d segments; scale data %s; PyTorch weights %s; open(): %d samples per round\n",
		fmtSize(cfg.ioSize), cfg.randTime, fmtSize(cfg.mmapSize), cfg.metaN, cfg.dirN, fmtSize(cfg.scaleSize), fmtSize(cfg.torchSize), openSamples)
	fmt.Fprintf(&w, "\nContenders: **tmpfs**, a directory on a tmpfs the bench mounts; **passthrough**, tensorfs with FUSE "+
		"passthrough; **classic**, tensorfs `--no-passthrough` (the daemon serves read and write); **loopback**, go-fuse's "+
		"stock `LoopbackNode` over the same tmpfs (`bench/loopbackfs`: 1 s entry/attr timeouts like tensorfs, which are "+
		"also go-fuse's defaults; passthrough as root). In the PyTorch case: tensorfs (`torch.from_file` of one segment in "+
		"each mode), **share_memory_()** (the launcher loads the file, shares it and forks the workers), **own copy** "+
		"(each worker loads the file). `A×B` is A's speed relative to B's: above 1 A is better, for times and latencies "+
		"as for rates.\n")

	for _, t := range b.tables() {
		b.writeTable(&w, t)
	}
	if len(b.res.facts) > 0 {
		fmt.Fprintf(&w, "\n")
		for _, f := range b.res.facts {
			fmt.Fprintf(&w, "- %s\n", f)
		}
	}

	fmt.Fprintf(&w, "\n## Targets\n\nPassthrough mode unless stated; ratios to tmpfs or loopback from the same run.\n\n")
	fmt.Fprintf(&w, "| target | measured | met |\n| --- | --- | --- |\n")
	var notes []string
	for _, t := range b.targets() {
		if !t.ok {
			continue
		}
		met := "yes"
		if !t.met {
			met = "**no**"
			if t.note != "" {
				notes = append(notes, fmt.Sprintf("%s: %s", t.desc, t.note))
				met = fmt.Sprintf("**no** (note %d)", len(notes))
			}
		}
		fmt.Fprintf(&w, "| %s | %s | %s |\n", t.desc, t.got, met)
	}
	if len(notes) > 0 {
		fmt.Fprintf(&w, "\nNotes on missed targets:\n\n")
		for i, n := range notes {
			fmt.Fprintf(&w, "%d. %s\n", i+1, n)
		}
	}
	b.writeUsage(&w)
	if len(b.res.profiles) > 0 {
		fmt.Fprintf(&w, "\n## Where the daemon's time goes\n\nOne more untimed run of each case on passthrough "+
			"tensorfs under `perf record -g`: the tensorfs functions with the largest share of the daemon's samples, "+
			"callees included (the rest is go-fuse, the Go runtime and the kernel).\n\n")
		for _, p := range b.res.profiles {
			fmt.Fprintf(&w, "- %s\n", p)
		}
	}
	return w.String()
}

func (b *bench) writeTable(w *strings.Builder, t table) {
	var rows []metricDef
	for _, m := range t.metrics {
		if len(b.res.vals[m]) > 0 {
			rows = append(rows, m)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(w, "\n## %s\n\n| case | unit |", t.title)
	for _, c := range t.cols {
		fmt.Fprintf(w, " %s |", c)
	}
	for _, r := range t.ratios {
		fmt.Fprintf(w, " %s×%s |", r[0], r[1])
	}
	fmt.Fprintf(w, "\n| --- | --- |%s\n", strings.Repeat(" ---: |", len(t.cols)+len(t.ratios)))
	for _, m := range rows {
		fmt.Fprintf(w, "| %s | %s |", m.name, m.unit)
		for _, c := range t.cols {
			med, lo, hi, ok := b.res.summary(m, c)
			switch {
			case !ok:
				fmt.Fprintf(w, " – |")
			case lo == hi:
				fmt.Fprintf(w, " %s |", fmtNum(med))
			default:
				fmt.Fprintf(w, " %s (%s–%s) |", fmtNum(med), fmtNum(lo), fmtNum(hi))
			}
		}
		for _, r := range t.ratios {
			if x, ok := b.res.ratio(m, r[0], r[1]); ok {
				fmt.Fprintf(w, " %.2f |", x)
			} else {
				fmt.Fprintf(w, " – |")
			}
		}
		fmt.Fprintf(w, "\n")
	}
}

// writeUsage renders the daemon's requests and CPU time per case.
func (b *bench) writeUsage(w *strings.Builder) {
	if len(b.res.order) == 0 {
		return
	}
	fmt.Fprintf(w, "\n## Daemon counters\n\nFrom `user.tensorfs.stats` read before and after every run (the read "+
		"itself taken off): FUSE requests by opcode per run, or per operation for the metadata loops, and the "+
		"daemon's CPU time; loopbackfs has no counters, its CPU time comes from /proc/PID/stat (10 ms ticks).\n\n")
	fmt.Fprintf(w, "| case | mount | requests | daemon CPU s per run | daemon CPU per GiB or per op |\n| --- | --- | --- | ---: | ---: |\n")
	for _, k := range b.res.order {
		u := b.res.usage[k]
		per := float64(u.runs)
		n := b.res.opsPerRun[k.caseName]
		if n > 0 {
			per *= float64(n)
		}
		req := b.requests(k.caseName, k.contender)
		if !u.counted {
			req = "not counted"
		}
		cost := "–"
		switch {
		case u.bytes > 0:
			cost = fmt.Sprintf("%.4f s/GiB", u.cpu/(float64(u.bytes)/giB))
		case n > 0:
			cost = fmt.Sprintf("%.1f µs/op", u.cpu/per*1e6)
		}
		fmt.Fprintf(w, "| %s | %s | %s | %.4f | %s |\n", k.caseName, k.contender, req, u.cpu/float64(u.runs), cost)
	}
}

// fmtNum writes v with about three significant digits.
func fmtNum(v float64) string {
	a := v
	if a < 0 {
		a = -a
	}
	switch {
	case a > 0 && a < 0.001:
		return "<0.001"
	case a >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case a >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	case a >= 1:
		return strconv.FormatFloat(v, 'f', 2, 64)
	}
	return strconv.FormatFloat(v, 'f', 3, 64)
}

// command is the command line that ran the bench.
func command() string {
	args := slices.Clone(os.Args)
	if strings.Contains(args[0], "go-build") {
		args[0] = "go run ./bench"
	}
	return strings.Join(args, " ")
}

func machine() string {
	model := "unknown CPU"
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		s := bufio.NewScanner(f)
		for s.Scan() {
			if v, ok := strings.CutPrefix(s.Text(), "model name"); ok {
				model = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
				break
			}
		}
		f.Close()
	}
	var si unix.Sysinfo_t
	mem := "?"
	if unix.Sysinfo(&si) == nil {
		mem = fmt.Sprintf("%.1f GiB", float64(si.Totalram)*float64(si.Unit)/giB)
	}
	return fmt.Sprintf("%s, %d CPUs (nproc), %s RAM", model, runtime.NumCPU(), mem)
}

func kernel() string {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return "?"
	}
	return "Linux " + unix.ByteSliceToString(u.Release[:])
}

// firstLine is the first line a command prints, or "?".
func firstLine(name string, args ...string) string {
	out, err := exec.Command(name, args...).Output()
	if err != nil {
		return "?"
	}
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	return line
}
