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
		{"Data path", []metricDef{mSeqWrite, mSeqRead, mRandIOPS, mRandLat, mRandP99, mMmapCold, mMmapWarm, mMmapSet, mOpenBig, mOpenSmall, mOpenFloor},
			[]string{tmpfsName, ptName, classicName}, [][2]string{{ptName, tmpfsName}, {classicName, tmpfsName}}},
		{"Metadata", []metricDef{mCreate, mOpen, mStat, mSetxattr, mGetxattr, mFloor, mReaddir},
			[]string{tmpfsName, ptName, classicName, loopName, loopStockName},
			[][2]string{{ptName, tmpfsName}, {classicName, tmpfsName}, {loopName, tmpfsName}, {ptName, loopName}, {ptName, loopStockName}}},
		{"Import and export", []metricDef{mImport, mImportRate, mExport, mExportRate},
			[]string{cpName, ptName, classicName, simCpName, simName},
			[][2]string{{ptName, cpName}, {classicName, cpName}, {simName, simCpName}}},
		{"Scale (one sample each)", []metricDef{mRSSDir, mPeakDir, mHeapDir, mRSSEmpty, mRSSData},
			[]string{ptName, classicName, loopName}, nil},
		{"PyTorch", []metricDef{mTorchReady, mTorchMem, mTorchLoose, mTorchCopies},
			[]string{ptName, classicName, shmName, copyName}, [][2]string{{ptName, shmName}}},
		{"A model in 4 workers (passthrough: tensorfs.load_into)", []metricDef{mModelReady, mModelMem},
			[]string{ptName, modelMmapName, modelLoadName}, [][2]string{{ptName, modelMmapName}, {ptName, modelLoadName}}},
		{fmt.Sprintf("Reference counts with %d processes mapping %d segments each", holderProcs, holderMappings),
			[]metricDef{mRefcountScan, mHoldersScan, mRefcountCached}, []string{ptName, classicName}, nil},
		{"Cluster (1 Gbit/s links)", []metricDef{mLinkRate, mPullTime, mUpload, mCPUPulled, mCPUServed, mCPUCores, mPulledRead},
			[]string{iperfName, oneName, loadName, fourName, eightName, seedsName, killedName, tmpfsName, pulledName},
			[][2]string{{oneName, iperfName}, {loadName, oneName}, {fourName, oneName}, {eightName, oneName}, {killedName, seedsName}, {pulledName, tmpfsName}}},
	}
}

// report renders BENCHMARKS.md.
func (b *bench) report() string {
	var w strings.Builder
	cfg := b.cfg
	fmt.Fprintf(&w, "# tensorfs benchmarks\n\n")
	fmt.Fprintf(&w, "Written by `bench/` (regenerate with `make bench`; `make bench-quick` for a smoke run). "+
		"Every case runs against each contender in every round, the contenders' order rotating from round to "+
		"round and running backwards every other round, on a shared and noisy machine: cells are the median of %d "+
		"rounds, with the minimum–maximum in brackets. The data path, readdir and import cases run one warm-up round "+
		"first that is not counted (under Facts, its speed against the counted medians).\n\n", cfg.rounds)
	fmt.Fprintf(&w, "- Command: `%s`\n", command())
	fmt.Fprintf(&w, "- Date: %s, run time %s\n", time.Now().UTC().Format("2006-01-02 15:04 MST"), b.elapsed.Round(time.Second))
	fmt.Fprintf(&w, "- Machine: %s\n", machine())
	torch := cmp.Or(b.torchVersion, "not run")
	fmt.Fprintf(&w, "- Kernel: %s; %s; %s; torch %s; tensorfs %s\n", kernel(), runtime.Version(), firstLine("fio", "--version"), torch, b.version)
	fmt.Fprintf(&w, "- Sizes: fio file %s, random reads %s per run; mmap and open() segment %s; metadata loops %d ops; "+
		"readdir directory %d segments; safetensors file %s of tensor data in %d tensors; scale data %s; PyTorch weights %s; "+
		"open(): %d samples per round; cluster model %s\n", fmtSize(cfg.ioSize), cfg.randTime, fmtSize(cfg.mmapSize), cfg.metaN, cfg.dirN,
		fmtSize(cfg.importSize), importTensors, fmtSize(cfg.scaleSize), fmtSize(cfg.torchSize), openSamples, fmtSize(cfg.clusterSize))
	fmt.Fprintf(&w, "\nContenders: **tmpfs**, a directory on a tmpfs the bench mounts; **passthrough**, tensorfs with FUSE "+
		"passthrough; **classic**, tensorfs `--no-passthrough` (the daemon serves read and write); **loopback**, go-fuse's "+
		"stock `LoopbackNode` over the same tmpfs (`bench/loopbackfs`, passthrough as root) mounted with tensorfs's "+
		"options, so that ratios to it measure handlers, not options: %s (not tensorfs's wider readahead window, "+
		"which only data cases would use). **loopback (stock)**, in the readdir case, is the same with go-fuse's "+
		"defaults but for: %s. In the import case, **cp** copies the safetensors file (in the work directory, "+
		"its pages cached) into a directory on the bench's tmpfs and that copy back to a file there, where "+
		"tensorfs runs `tensorfs import FILE DIR` and `tensorfs export DIR FILE`; **cuda:0 (sim)** imports into "+
		"a cuda:0 directory of a passthrough mount with `--gpu sim` (the segments live in the simulated GPU's "+
		"memory, which the daemon serves), against **cp to cuda:0 (sim)**, cp of the file into that directory: "+
		"one segment on the same device, the sim's own copy speed. In the PyTorch case: tensorfs (`torch.from_file` of one segment in "+
		"each mode), **share_memory_()** (the launcher loads the file, shares it and forks the workers), **own copy** "+
		"(each worker loads the file). `A×B` is A's speed relative to B's: above 1 A is better, for times and latencies "+
		"as for rates.\n", b.loopDesc(loopName), b.loopDesc(loopStockName))

	for _, t := range b.tables() {
		b.writeTable(&w, t)
	}
	b.writeSim(&w)
	facts := append(b.dataPathFacts(), b.res.facts...)
	if f := b.warmFact(); f != "" {
		facts = append(facts, f)
	}
	if len(facts) > 0 {
		fmt.Fprintf(&w, "\n## Facts\n\nMeasured in this run, not targets.\n\n")
		for _, f := range facts {
			fmt.Fprintf(&w, "- %s\n", f)
		}
	}

	fmt.Fprintf(&w, "\n## Targets\n\nPassthrough mode unless stated; ratios to tmpfs, loopback or cp from the same run: "+
		"the ratio of the medians, then in brackets its range over the rounds, from the contender's worst round against "+
		"the reference's best to its best against the reference's worst. A target inside that range is within noise: "+
		"the rounds cannot tell met from missed, and the note counts the rounds in which it was met, each contender's "+
		"sample against the reference's of the same round.\n\n")
	fmt.Fprintf(&w, "| target | measured | met |\n| --- | --- | --- |\n")
	var notes []string
	for _, t := range b.targets() {
		if !t.ok {
			continue
		}
		met := "yes"
		if !t.met {
			met = "**no**"
		}
		if t.note != "" {
			notes = append(notes, fmt.Sprintf("%s: %s", t.desc, t.note))
			met += fmt.Sprintf(" (note %d)", len(notes))
		}
		fmt.Fprintf(&w, "| %s | %s | %s |\n", t.desc, t.got, met)
	}
	if len(notes) > 0 {
		fmt.Fprintf(&w, "\nNotes, from this run's measurements and counters:\n\n")
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

// warmFact compares the warm-up rounds, not counted, with the counted
// medians: the warm-up's speed relative to the median, per contender.
func (b *bench) warmFact() string {
	var parts []string
	for _, t := range b.tables() {
		for _, m := range t.metrics {
			var cs []string
			for _, c := range t.cols {
				w := b.res.warm[m][c]
				med, ok := b.res.median(m, c)
				if len(w) == 0 || !ok || med == 0 || w[0] == 0 {
					continue
				}
				x := w[0] / med
				if !m.higher {
					x = med / w[0]
				}
				cs = append(cs, fmt.Sprintf("%s %.2f", c, x))
			}
			if len(cs) > 0 {
				parts = append(parts, m.name+": "+strings.Join(cs, ", "))
			}
		}
	}
	if len(parts) == 0 {
		return ""
	}
	return "Warm-up rounds, run before the counted ones and not counted: speed relative to the counted median " +
		"(below 1: slower): " + strings.Join(parts, "; ")
}

// loopDesc lists the mount options a loopbackfs contender reported.
func (b *bench) loopDesc(name string) string {
	return "`" + strings.ReplaceAll(b.loopOptions[name], ",", "`, `") + "`"
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
