package main

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// target is one goal of the benchmark issue and how this run did.
type target struct {
	desc string
	got  string
	met  bool
	ok   bool // measured in this run
	note string
}

// caseOf names the counted case (usage key) behind a metric.
var caseOf = map[metricDef]string{
	mSeqWrite: "seq write", mSeqRead: "seq read", mRandIOPS: "rand read 4 KiB",
	mMmapCold: "mmap cold touch", mMmapWarm: "mmap warm sum", mMmapSet: "mmap memset + msync",
	mOpenBig: "open() cached", mOpenSmall: "open() cached", mOpenFloor: "getxattr after reads",
	mCreate: "create+write+stat+unlink", mOpen: "open+close", mStat: "stat",
	mSetxattr: "setxattr", mGetxattr: "getxattr", mFloor: "getxattr from memory", mReaddir: "readdir",
	mImport: "tensorfs import",
}

// targets evaluates the targets against this run's medians.
func (b *bench) targets() []target {
	cfg := b.cfg
	var ts []target
	ratio := func(desc string, m metricDef, c, ref string, want float64) {
		x, ok := b.res.ratio(m, c, ref)
		t := target{desc: desc, ok: ok, met: x >= want}
		if ok {
			a, _ := b.res.median(m, c)
			r, _ := b.res.median(m, ref)
			lo, hi := b.res.ratioRange(m, c, ref)
			t.got = fmt.Sprintf("%.2f× (%.2f–%.2f; %s vs %s %s)", x, lo, hi, fmtNum(a), fmtNum(r), m.unit)
			t.note = b.ratioNote(m, c, ref, want, t.met)
		}
		ts = append(ts, t)
	}
	below := func(desc string, m metricDef, c string, limit float64, extra string) {
		v, ok := b.res.median(m, c)
		t := target{desc: desc, ok: ok, met: v < limit, got: fmt.Sprintf("%s %s%s", fmtNum(v), m.unit, extra)}
		if ok && !t.met {
			t.note = b.why(m, c, "", limit)
		}
		ts = append(ts, t)
	}

	ratio("seq read ≥ 0.95× tmpfs", mSeqRead, ptName, tmpfsName, 0.95)
	ratio("seq write ≥ 0.95× tmpfs", mSeqWrite, ptName, tmpfsName, 0.95)
	ratio("4 KiB random read IOPS ≥ 0.9× tmpfs", mRandIOPS, ptName, tmpfsName, 0.9)
	ratio("mmap cold touch ≥ 0.95× tmpfs", mMmapCold, ptName, tmpfsName, 0.95)
	ratio("mmap warm sum ≥ 0.95× tmpfs", mMmapWarm, ptName, tmpfsName, 0.95)
	small, _ := b.res.median(mOpenSmall, ptName)
	below(fmt.Sprintf("open() of a cached %s segment < 1 ms", fmtSize(cfg.mmapSize)), mOpenBig, ptName, 1000,
		fmt.Sprintf(" (4 KiB segment: %s µs)", fmtNum(small)))
	ratio(fmt.Sprintf("open() of a cached %s segment ≤ 2× tmpfs's time", fmtSize(cfg.mmapSize)), mOpenBig, ptName, tmpfsName, 0.5)
	ratio("open() of a cached 4 KiB segment ≤ 2× tmpfs's time", mOpenSmall, ptName, tmpfsName, 0.5)
	ratio(mCreate.name+" ≥ 2× loopback", mCreate, ptName, loopName, 2)
	ratio(mOpen.name+" ≥ 2× loopback", mOpen, ptName, loopName, 2)
	ratio(mSetxattr.name+" ≥ 1.2× loopback", mSetxattr, ptName, loopName, 1.2)
	ratio(mGetxattr.name+" ≥ 1.2× loopback", mGetxattr, ptName, loopName, 1.2)
	ratio(mReaddir.name+" ≥ 2× loopback", mReaddir, ptName, loopName, 2)
	ratio("stat of an unchanged segment ≥ 0.5× tmpfs", mStat, ptName, tmpfsName, 0.5)
	ratio("--no-passthrough: seq read ≥ 0.5× tmpfs", mSeqRead, classicName, tmpfsName, 0.5)
	below(fmt.Sprintf("daemon RSS with %d segments < 64 MiB", cfg.dirN), mRSSDir, ptName, 64,
		fmt.Sprintf(" (loopback: %s MiB)", fmtNum(b.medianOr0(mRSSDir, loopName))))
	empty, ok1 := b.res.median(mRSSEmpty, ptName)
	full, ok2 := b.res.median(mRSSData, ptName)
	ts = append(ts, target{
		desc: fmt.Sprintf("daemon RSS flat as data grows (≤ 16 MiB more with %s)", fmtSize(cfg.scaleSize)),
		ok:   ok1 && ok2, met: full-empty <= 16,
		got: fmt.Sprintf("%s → %s MiB", fmtNum(empty), fmtNum(full)),
	})
	copies, ok := b.res.median(mTorchCopies, ptName)
	t := target{desc: "PyTorch: one copy of the weights in total", ok: ok, met: copies <= 1.1,
		got: fmt.Sprintf("%.2f copies", copies)}
	if !t.met {
		t.note = b.why(mTorchCopies, ptName, "", 0)
	}
	ts = append(ts, t)
	ratio("PyTorch: ready faster than share_memory_()", mTorchReady, ptName, shmName, 1)
	ratio("model: load_into ready in ≤ 1.1× the time of mmap views of a safetensors file", mModelReady, ptName, modelMmapName, 1/1.1)
	ratio("model: load_into memory within 5% of mmap views of a safetensors file", mModelMem, ptName, modelMmapName, 1/1.05)
	ratio("tensorfs import ≥ 0.9× cp", mImport, ptName, cpName, 0.9)
	ratio("tensorfs import into cuda:0 (sim) ≥ 0.9× cp into it", mImport, simName, simCpName, 0.9)
	ratio("cluster: one pull ≥ 0.9× the link (iperf3)", mLinkRate, oneName, iperfName, 0.9)
	ratio("cluster: load_into on a node that has not pulled ≤ 1.1× one pull's time", mPullTime, loadName, oneName, 1/1.1)
	ratio("cluster: 4 nodes pulling at once ≤ 1.2× one pull's time", mPullTime, fourName, oneName, 1/1.2)
	below("cluster: node1 uploads ≤ 1.5× the model while 4 nodes pull", mUpload, fourName, 1.5, "")
	ratio("cluster: reads of pulled segments ≥ 0.95× tmpfs", mPulledRead, pulledName, tmpfsName, 0.95)
	return ts
}

// ratioNote is the note on a ratio target: whether the rounds can tell
// met from missed (noise), and for a miss what the counters show.
func (b *bench) ratioNote(m metricDef, c, ref string, want float64, met bool) string {
	var parts []string
	lo, hi := b.res.ratioRange(m, c, ref)
	k, n := b.res.roundsMet(m, c, ref, want)
	if lo < want && want <= hi {
		parts = append(parts, fmt.Sprintf("within noise: %.2f× lies in the ratio range %.2f–%.2f× of the two "+
			"contenders' rounds; met in %d of %d rounds", want, lo, hi, k, n))
	} else if !met {
		parts = append(parts, fmt.Sprintf("missed in every pairing of rounds (ratio range %.2f–%.2f×)", lo, hi))
	}
	if !met {
		if w := b.why(m, c, ref, want); w != "" {
			parts = append(parts, w)
		}
	}
	return strings.Join(parts, "; ")
}

// why explains from this run's measurements and counters what stands
// between contender c and a target on m (ref and want for a ratio to
// ref); "" where the run has nothing to say.
func (b *bench) why(m metricDef, c, ref string, want float64) string {
	switch m {
	case mCreate, mOpen, mSetxattr, mGetxattr, mReaddir, mOpenBig, mOpenSmall, mStat:
		return b.floorNote(m, c, ref, want)
	case mRSSDir:
		heap, rss, lheap := b.medianOr0(mHeapDir, c), b.medianOr0(mRSSDir, c), b.medianOr0(mHeapDir, loopName)
		if heap == 0 {
			return ""
		}
		return fmt.Sprintf("the daemon keeps %s MiB of live heap after its last GC, %.2f KiB per segment of the "+
			"directory, with RSS at %s MiB; loopback keeps %s MiB of live heap with RSS at %s MiB",
			fmtNum(heap), heap*kiB/float64(b.cfg.dirN), fmtNum(rss), fmtNum(lheap), fmtNum(b.medianOr0(mRSSDir, loopName)))
	case mTorchCopies:
		return b.copiesNote(c)
	}
	return b.daemonShare(m, c)
}

// daemonShare says how much of a data case's time the daemon spent on
// the CPU, from its counters.
func (b *bench) daemonShare(m metricDef, c string) string {
	k, ok := caseOf[m]
	u := b.res.usage[usageKey{k, c}]
	med, ok2 := b.res.median(m, c)
	if !ok || !ok2 || u == nil || u.runs == 0 || med == 0 {
		return ""
	}
	cpu := u.cpu / float64(u.runs)
	perRun := float64(u.bytes) / float64(u.runs)
	var wall float64
	switch m.unit {
	case "MiB/s":
		wall = perRun / miB / med
	case "GiB/s":
		wall = perRun / giB / med
	case "kIOPS":
		wall = b.cfg.randTime.Seconds()
	case "s":
		wall = med
	default:
		return ""
	}
	s := fmt.Sprintf("the daemon served %s, using %.4f s of CPU per run against the run's %.3f s (%.1f%%)",
		b.requests(k, c), cpu, wall, 100*cpu/wall)
	if reads := u.requests["READ"]; reads > 0 {
		s += fmt.Sprintf("; its READs average %s", fmtSize(u.bytes/reads/kiB*kiB))
	}
	return s
}

// floorNote puts a metadata case's time per operation beside what the
// target allows and the round-trip floor: a request answered from memory
// with no system call, measured on the same mount in this run.
func (b *bench) floorNote(m metricDef, c, ref string, want float64) string {
	k := caseOf[m]
	floor := mFloor
	if m == mOpenBig || m == mOpenSmall {
		floor = mOpenFloor // timed alone after the same reads
	}
	w, ok1 := b.perOp(m, c)
	f, ok2 := b.perOp(floor, c)
	if !ok1 || !ok2 {
		return ""
	}
	u := b.res.usage[usageKey{k, c}]
	var reqs, async float64 // requests the caller waits for, and the others
	if u != nil {
		per := float64(u.runs * max(b.res.opsPerRun[k], 1))
		for op, n := range u.requests {
			if unawaited[op] {
				async += float64(n) / per
			} else {
				reqs += float64(n) / per
			}
		}
	}
	ops := b.res.opsPerRun[k]
	unit := "per op"
	if ops == 0 && m.unit != "µs" {
		unit = "per run"
	}
	x := want // a limit in µs
	var s strings.Builder
	if ref != "" {
		r, ok := b.perOp(m, ref)
		if !ok {
			return ""
		}
		x = r / want
		fmt.Fprintf(&s, "%.2f× %s needs ≤ %s µs %s (%s takes %s)", want, ref, fmtNum(x), unit, ref, fmtNum(r))
	} else {
		fmt.Fprintf(&s, "the target allows %s µs %s", fmtNum(x), unit)
	}
	fmt.Fprintf(&s, "; %s takes %s µs, with %s; one request answered from memory takes %s µs on this mount "+
		"(%s)", c, fmtNum(w), b.requests(k, c), fmtNum(f), floor.name)
	if lf, ok := b.perOp(floor, ref); ok && ref == loopName {
		fmt.Fprintf(&s, ", where loopback answers it, absent there, after one lgetxattr in %s µs", fmtNum(lf))
	}
	// The daemon's CPU time is read around each run, the reads' own cost
	// taken off as measured once more: only runs of 10 ms or more dwarf
	// that correction's error.
	cpu, okc := b.cpuPerOp(k, c)
	okc = okc && w*float64(max(ops, 1)) >= 10e3
	if okc {
		fmt.Fprintf(&s, "; daemon CPU %s µs %s", fmtNum(cpu), unit)
		if lc, ok := b.cpuPerOp(k, ref); ref != "" && ok {
			fmt.Fprintf(&s, ", %s's %s µs", ref, fmtNum(lc))
		}
	}
	if t, ok := b.perOp(m, tmpfsName); ok && ref != tmpfsName && t > x {
		fmt.Fprintf(&s, "; tmpfs itself, with no FUSE at all, takes %s µs", fmtNum(t))
	}
	if async >= 0.01 {
		fmt.Fprintf(&s, "; of the requests, %s %s are ones the caller does not wait for (%s), counted below as "+
			"taking no time of its own", fmtNum(async), unit, strings.Join(slices.Sorted(maps.Keys(unawaited)), ", "))
	}
	if lw, ok := b.perOp(m, ref); ok && ref == loopName && reqs >= 0.01 && reqs*f < x {
		if lf, ok := b.perOp(floor, ref); ok {
			fmt.Fprintf(&s, "; the target leaves %s µs beyond %s round trips at the floor, and loopback takes %s µs "+
				"beyond as many at its own", fmtNum(x-reqs*f), fmtNum(reqs), fmtNum(lw-reqs*lf))
		}
	}
	switch {
	case reqs < 0.01:
		fmt.Fprintf(&s, ": no request reaches the daemon, so the %s µs past the target are the kernel's", fmtNum(w-x))
	case f > x:
		fmt.Fprintf(&s, ": the round trip alone (kernel and go-fuse, %s µs) takes more than the %s µs the target allows",
			fmtNum(f), fmtNum(x))
	case reqs*f > x:
		fmt.Fprintf(&s, ": %s requests at the floor's %s µs make %s µs, more than the %s µs allowed: the target "+
			"needs fewer requests", fmtNum(reqs), fmtNum(f), fmtNum(reqs*f), fmtNum(x))
	default:
		fmt.Fprintf(&s, ": %s requests at the floor's cost make %s µs; the time beyond those round trips, %s µs, "+
			"is what misses the target, by %s µs", fmtNum(reqs), fmtNum(reqs*f), fmtNum(w-reqs*f), fmtNum(w-x))
	}
	return s.String()
}

// unawaited are the requests the kernel sends without making the caller
// wait for the answer: close(2) returns before RELEASE is served, and
// FORGET has no answer.
var unawaited = map[string]bool{"RELEASE": true, "RELEASEDIR": true, "FORGET": true, "BATCH_FORGET": true}

// perOp is a metadata metric's median as µs per operation (per run for
// a metric in ms).
func (b *bench) perOp(m metricDef, c string) (float64, bool) {
	v, ok := b.res.median(m, c)
	if !ok || v == 0 {
		return 0, false
	}
	switch m.unit {
	case "µs":
		return v, true
	case "ms":
		return v * 1e3, true
	case "k ops/s", "k files/s":
		return 1e3 / v, true
	}
	return 0, false
}

// cpuPerOp is a case's daemon CPU in µs per operation, or per run for
// cases without operations; ok is false when the case was not observed.
func (b *bench) cpuPerOp(caseName, c string) (float64, bool) {
	u := b.res.usage[usageKey{caseName, c}]
	if u == nil || u.runs == 0 {
		return 0, false
	}
	return u.cpu / float64(u.runs*max(b.res.opsPerRun[caseName], 1)) * 1e6, true
}

// dataPathFacts reports what passthrough's daemon did in the cases that
// move data: the READ and WRITE requests it served (the bench refuses a
// mount without passthrough) and its CPU time per GiB.
func (b *bench) dataPathFacts() []string {
	var rw, moved int64
	cases := 0
	worst, best, worstCase := -1.0, -1.0, ""
	for _, k := range b.res.order {
		u := b.res.usage[k]
		if k.contender != ptName || u.bytes == 0 {
			continue
		}
		rw += u.requests["READ"] + u.requests["WRITE"]
		moved += u.bytes
		cases++
		perGiB := u.cpu / (float64(u.bytes) / giB)
		if perGiB > worst {
			worst, worstCase = perGiB, k.caseName
		}
		if best < 0 || perGiB < best {
			best = perGiB
		}
	}
	if moved == 0 {
		return nil
	}
	return []string{
		fmt.Sprintf("passthrough: the daemon served %d READ and WRITE requests in %d data cases moving %s", rw, cases, fmtSize(moved/miB*miB)),
		fmt.Sprintf("passthrough: daemon CPU per GiB moved, %.4f–%.4f s across those cases (highest: %s)", best, worst, worstCase),
	}
}

// medianOr0 is the median of m for contender c, or 0 without samples.
func (b *bench) medianOr0(m metricDef, c string) float64 {
	v, _ := b.res.median(m, c)
	return v
}

// requests lists a case's requests per run or per op.
func (b *bench) requests(caseName, contender string) string {
	u := b.res.usage[usageKey{caseName, contender}]
	if u == nil || !u.counted {
		return "no requests counted"
	}
	per, unit := float64(u.runs), "per run"
	if n := b.res.opsPerRun[caseName]; n > 0 {
		per *= float64(n)
		unit = "per op"
	}
	ops := slices.Collect(maps.Keys(u.requests))
	slices.SortFunc(ops, func(a, c string) int { return cmp.Or(cmp.Compare(u.requests[c], u.requests[a]), strings.Compare(a, c)) })
	var parts []string
	for _, op := range ops {
		parts = append(parts, op+" "+fmtNum(float64(u.requests[op])/per))
	}
	if len(parts) == 0 {
		return "no requests " + unit
	}
	return strings.Join(parts, ", ") + " " + unit
}
