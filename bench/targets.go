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
			t.got = fmt.Sprintf("%.2f× (%s vs %s %s)", x, fmtNum(a), fmtNum(r), m.unit)
			if !t.met {
				t.note = b.missNote(m, c, ref, want)
			}
		}
		ts = append(ts, t)
	}
	below := func(desc string, m metricDef, c string, limit float64, extra string) {
		v, ok := b.res.median(m, c)
		t := target{desc: desc, ok: ok, met: v < limit, got: fmt.Sprintf("%s %s%s", fmtNum(v), m.unit, extra)}
		if ok && !t.met {
			t.note = b.missNote(m, c, "", 0)
		}
		ts = append(ts, t)
	}

	ratio("seq read ≥ 0.95× tmpfs", mSeqRead, ptName, tmpfsName, 0.95)
	ratio("seq write ≥ 0.95× tmpfs", mSeqWrite, ptName, tmpfsName, 0.95)
	ratio("4 KiB random read IOPS ≥ 0.9× tmpfs", mRandIOPS, ptName, tmpfsName, 0.9)
	ratio("mmap cold touch ≥ 0.95× tmpfs", mMmapCold, ptName, tmpfsName, 0.95)
	ratio("mmap warm sum ≥ 0.95× tmpfs", mMmapWarm, ptName, tmpfsName, 0.95)
	ts = append(ts, b.dataPathTargets()...)
	small, _ := b.res.median(mOpenSmall, ptName)
	below(fmt.Sprintf("open() of a cached %s segment < 1 ms", fmtSize(cfg.mmapSize)), mOpenBig, ptName, 1000,
		fmt.Sprintf(" (4 KiB segment: %s µs)", fmtNum(small)))
	for _, m := range []metricDef{mCreate, mOpen, mSetxattr, mGetxattr, mReaddir} {
		ratio(m.name+" ≥ 2× loopback", m, ptName, loopName, 2)
	}
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
	ts = append(ts, target{desc: "PyTorch: one copy of the weights in total", ok: ok, met: copies <= 1.1,
		got: fmt.Sprintf("%.2f copies", copies), note: b.missNote(mTorchCopies, ptName, "", 0)})
	ratio("PyTorch: ready faster than share_memory_()", mTorchReady, ptName, shmName, 1)
	return ts
}

// dataPathTargets: in passthrough the daemon serves no READ or WRITE,
// and spends under 0.05 CPU seconds per GiB in every case that moves data.
func (b *bench) dataPathTargets() []target {
	var rw, moved int64
	cases := 0
	worst, worstCase := -1.0, ""
	for _, k := range b.res.order {
		u := b.res.usage[k]
		if k.contender != ptName || u.bytes == 0 {
			continue
		}
		rw += u.requests["READ"] + u.requests["WRITE"]
		moved += u.bytes
		cases++
		if perGiB := u.cpu / (float64(u.bytes) / giB); perGiB > worst {
			worst, worstCase = perGiB, k.caseName
		}
	}
	if moved == 0 {
		return nil
	}
	cpu := target{desc: "daemon CPU < 0.05 s per GiB moved, in every data case", ok: true, met: worst < 0.05,
		got: fmt.Sprintf("highest %.4f s/GiB (%s)", worst, worstCase)}
	if !cpu.met {
		cpu.note = cmp.Or(b.killprivNote(worstCase), "the daemon served "+b.requests(worstCase, ptName))
	}
	return []target{
		{desc: "daemon serves 0 READ/WRITE requests", ok: true, met: rw == 0,
			got:  fmt.Sprintf("%d in %d data cases moving %s", rw, cases, fmtSize(moved/miB*miB)),
			note: "an open was answered without FOPEN_PASSTHROUGH, so the kernel sent the data to the daemon (see the counters)"},
		cpu,
	}
}

// missNote says what the samples show about a missed target: whether
// the target is within the noise (the best round of c against the worst
// of ref reaches want), and why it is missed where missNotes knows.
func (b *bench) missNote(m metricDef, c, ref string, want float64) string {
	var parts []string
	if ref != "" {
		_, lo, hi, ok1 := b.res.summary(m, c)
		_, rlo, rhi, ok2 := b.res.summary(m, ref)
		best := hi / rlo
		if !m.higher {
			best = rhi / lo
		}
		if ok1 && ok2 && best >= want {
			parts = append(parts, fmt.Sprintf("within this machine's noise: the best round of %s against the worst of %s reaches %.2f×", c, ref, best))
		}
	}
	if n := b.why(m, c); n != "" {
		parts = append(parts, n)
	}
	return strings.Join(parts, "; ")
}

// why explains, from this run's counters, why contender c misses a target
// on m and what would reach it; "" where it has no explanation.
func (b *bench) why(m metricDef, c string) string {
	if c == classicName {
		u := b.res.usage[usageKey{"seq read", c}]
		if m != mSeqRead || u == nil {
			return ""
		}
		reads := max(u.requests["READ"], 1)
		return fmt.Sprintf("the daemon serves every byte (%s, %.2f s CPU per GiB): each READ of %s is a round trip "+
			"through the daemon (go-fuse splices the reply); fewer, larger READs (a wider readahead window on the "+
			"FUSE mount) would reach it, passthrough does", b.requests("seq read", c), u.cpu/(float64(u.bytes)/giB),
			fmtSize(u.bytes/reads/kiB*kiB))
	}
	switch m {
	case mSeqWrite, mSeqRead, mRandIOPS, mMmapCold, mMmapWarm:
		if n := b.killprivNote("seq write"); m == mSeqWrite && n != "" {
			return n
		}
		k := map[metricDef]string{mSeqWrite: "seq write", mSeqRead: "seq read", mRandIOPS: "rand read 4 KiB",
			mMmapCold: "mmap cold touch", mMmapWarm: "mmap warm sum"}[m]
		if u := b.res.usage[usageKey{k, ptName}]; u == nil || u.requests["READ"]+u.requests["WRITE"] > 0 {
			return ""
		}
		if m == mMmapCold || m == mMmapWarm {
			return fmt.Sprintf("the daemon serves none of it (%s): a passthrough mapping is the backing file's own, "+
				"so faults and loads are shmem's as on tmpfs and tensorfs has no part in the gap", b.requests(k, ptName))
		}
		extra := ""
		if m == mRandIOPS {
			extra = fmt.Sprintf(" (here %s µs more per 4 KiB read, mean latency)",
				fmtNum(b.medianOr0(mRandLat, ptName)-b.medianOr0(mRandLat, tmpfsName)))
		}
		return fmt.Sprintf("the daemon serves none of the data (%s), so the gap is in the kernel: every read(2) "+
			"and write(2) of a passthrough file goes through FUSE's read_iter or write_iter and then the backing "+
			"file's (a credential override per call) before shmem, a fixed cost per call that shows most with "+
			"small calls%s", b.requests(k, ptName), extra)
	case mCreate:
		k := "create+write+stat+unlink"
		explain := "2× needs fewer round trips than loopback's"
		if b.count(k, "FLUSH") > 0 {
			explain += "; FOPEN_NOFLUSH would drop the FLUSH (a tmpfs backing has nothing to flush on close)"
		}
		return b.metaNote(k, explain+"; these stay: the LOOKUP before CREATE, the GETXATTR of "+
			"security.capability before the first write to a new file (once per inode with "+
			"FUSE_HANDLE_KILLPRIV_V2, before every write without), and the GETATTRs (the kernel drops a "+
			"directory's attributes on every create and unlink, default_permissions needs them on the next "+
			"path walk, and a write drops the file's size)")
	case mOpen:
		explain := ""
		if b.count("open+close", "FLUSH") > 0 {
			explain = "FOPEN_NOFLUSH would drop the FLUSH, a third of the requests; "
		}
		return b.metaNote("open+close", explain+"OPEN and RELEASE stay, since passthrough needs an OPEN to hand "+
			"the kernel the backing file; beside the handlers"+b.seeProfile()+", the round trip itself (kernel, "+
			"go-fuse, wake-ups) is what stands between it and 2×")
	case mSetxattr, mGetxattr:
		k := map[metricDef]string{mSetxattr: "setxattr", mGetxattr: "getxattr"}[m]
		return b.metaNote(k,
			"FUSE caches no extended attributes, so each call is one round trip to either daemon and only the "+
				"handler differs"+b.seeProfile()+": 2× loopback needs the round trip itself (kernel, go-fuse) "+
				"halved, which no handler can do")
	case mRSSDir:
		heap, rss, lheap := b.medianOr0(mHeapDir, ptName), b.medianOr0(mRSSDir, ptName), b.medianOr0(mHeapDir, loopName)
		if heap == 0 {
			return ""
		}
		return fmt.Sprintf("the daemon keeps %s MiB of live heap after GC, %.2f KiB per segment the kernel has looked "+
			"up (the case stats each one, and go-fuse keeps an Inode per lookup until the kernel forgets it), and "+
			"Go's GC lets RSS (%s MiB) run well past that; loopback, go-fuse's tree alone, keeps %s MiB. "+
			"Under 64 MiB needs less state per segment (a leaner node, or a RawFileSystem keyed by backing inode "+
			"instead of go-fuse's Inode tree) and a GC memory limit (GOMEMLIMIT)",
			fmtNum(heap), heap*kiB/float64(b.cfg.dirN), fmtNum(rss), fmtNum(lheap))
	case mReaddir:
		explain := "every listing is answered by the daemon again"
		if b.count("readdir", "READDIRPLUS") > b.count("readdir", "READDIR") {
			explain += ", with a lookup of every entry by READDIRPLUS"
		}
		return b.metaNote("readdir", explain+b.seeProfile()+"; FOPEN_CACHE_DIR with KEEP_CACHE on OPENDIR "+
			"lets the kernel keep the listing (changes through the mount reset it; the daemon's own removals "+
			"are notified already)")
	}
	return ""
}

// seeProfile points to the profile section when the run has one.
func (b *bench) seeProfile() string {
	if len(b.res.profiles) == 0 {
		return ""
	}
	return " (profile below)"
}

// count is how many op requests passthrough tensorfs served for a case.
func (b *bench) count(caseName, op string) int64 {
	if u := b.res.usage[usageKey{caseName, ptName}]; u != nil {
		return u.requests[op]
	}
	return 0
}

// medianOr0 is the median of m for contender c, or 0 without samples.
func (b *bench) medianOr0(m metricDef, c string) float64 {
	v, _ := b.res.median(m, c)
	return v
}

// killprivNote explains daemon GETXATTR requests during writes, when
// there is one for every few MiB written: the kernel asking for
// security.capability before each write(2).
func (b *bench) killprivNote(caseName string) string {
	u := b.res.usage[usageKey{caseName, ptName}]
	n := b.count(caseName, "GETXATTR")
	if u == nil || u.bytes == 0 || n*4*miB < u.bytes {
		return ""
	}
	return fmt.Sprintf("before every write(2) the kernel asks the daemon for security.capability (%s: %s GETXATTR "+
		"per run), since a FUSE superblock is not SB_NOSEC; negotiating FUSE_HANDLE_KILLPRIV_V2 (the daemon "+
		"then clears set-id bits itself) lets the kernel ask once per inode", caseName, fmtNum(float64(n)/float64(u.runs)))
}

// metaNote puts the requests and daemon CPU behind a metadata case beside
// loopback's CPU and the explanation.
func (b *bench) metaNote(caseName, explain string) string {
	t, l := b.res.usage[usageKey{caseName, ptName}], b.res.usage[usageKey{caseName, loopName}]
	if t == nil || l == nil {
		return explain
	}
	ops := b.res.opsPerRun[caseName]
	per := func(u *usage) string {
		if ops == 0 {
			return fmt.Sprintf("%.1f ms per run", u.cpu/float64(u.runs)*1e3)
		}
		return fmt.Sprintf("%.1f µs per op", u.cpu/float64(u.runs*ops)*1e6)
	}
	return fmt.Sprintf("the kernel sends tensorfs %s; daemon CPU %s against loopback's %s; %s",
		b.requests(caseName, ptName), per(t), per(l), explain)
}

// requests lists a case's requests per run or per op.
func (b *bench) requests(caseName, contender string) string {
	u := b.res.usage[usageKey{caseName, contender}]
	if u == nil {
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
