package main

import (
	"slices"
	"time"
)

// metricDef names a measured quantity.
type metricDef struct {
	name   string
	unit   string
	higher bool // higher is better
}

// results holds every sample of a run and the daemon usage behind them.
type results struct {
	vals  map[metricDef]map[string][]float64 // metric -> contender -> samples
	usage map[usageKey]*usage
	order []usageKey // usage keys in the order they first ran
	// opsPerRun is how many operations one run of a case does, for the
	// report's requests per operation.
	opsPerRun map[string]int
	facts     []string // lines for the report that are not samples
	profiles  []string // where the daemon's time goes, per profiled case
	// warming is set during a warm-up round, whose samples go to warm
	// and whose daemon usage is not counted.
	warming bool
	warm    map[metricDef]map[string][]float64
}

// usageKey is one case run against one tensorfs contender.
type usageKey struct{ caseName, contender string }

// usage is what a tensorfs daemon did for one case, summed over its runs.
type usage struct {
	runs     int
	requests map[string]int64
	cpu      float64 // daemon CPU seconds
	// counted is false for daemons without request counters (loopbackfs).
	counted bool
	bytes   int64 // bytes moved through the mount
}

func (r *results) init() {
	r.vals = map[metricDef]map[string][]float64{}
	r.warm = map[metricDef]map[string][]float64{}
	r.usage = map[usageKey]*usage{}
	r.opsPerRun = map[string]int{}
}

func (r *results) add(m metricDef, contender string, v float64) {
	vals := r.vals
	if r.warming {
		vals = r.warm
	}
	if vals[m] == nil {
		vals[m] = map[string][]float64{}
	}
	vals[m][contender] = append(vals[m][contender], v)
}

// summary returns the median, minimum and maximum of a metric's samples
// for a contender; ok is false when there are none.
func (r *results) summary(m metricDef, contender string) (med, lo, hi float64, ok bool) {
	s := slices.Clone(r.vals[m][contender])
	if len(s) == 0 {
		return 0, 0, 0, false
	}
	slices.Sort(s)
	med = s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return med, s[0], s[len(s)-1], true
}

// median is summary's median alone.
func (r *results) median(m metricDef, contender string) (float64, bool) {
	med, _, _, ok := r.summary(m, contender)
	return med, ok
}

// ratio is how contender compares with ref on m: above 1 is better than
// ref, whichever way the metric points.
func (r *results) ratio(m metricDef, contender, ref string) (float64, bool) {
	a, ok1 := r.median(m, contender)
	b, ok2 := r.median(m, ref)
	if !ok1 || !ok2 || a == 0 || b == 0 {
		return 0, false
	}
	if m.higher {
		return a / b, true
	}
	return b / a, true
}

// ratioRange is the range of contender's ratio to ref that their rounds
// allow: from contender's worst round against ref's best to its best
// round against ref's worst.
func (r *results) ratioRange(m metricDef, contender, ref string) (lo, hi float64) {
	_, clo, chi, ok1 := r.summary(m, contender)
	_, rlo, rhi, ok2 := r.summary(m, ref)
	if !ok1 || !ok2 || clo == 0 || rlo == 0 {
		return 0, 0
	}
	if m.higher {
		return clo / rhi, chi / rlo
	}
	return rlo / chi, rhi / clo
}

// roundsMet counts the rounds in which contender's sample is at least
// want times ref's of the same round, out of n rounds both have. Samples
// are added round by round, the same number per contender, so the i-th
// samples of two contenders come from the same round.
func (r *results) roundsMet(m metricDef, contender, ref string, want float64) (k, n int) {
	a, b := r.vals[m][contender], r.vals[m][ref]
	n = min(len(a), len(b))
	for i := range n {
		x := a[i] / b[i]
		if !m.higher {
			x = b[i] / a[i]
		}
		if x >= want {
			k++
		}
	}
	return k, n
}

// settle is the pause before every observed run, the same for every
// contender, so that the daemon's work on the counters read just before
// (and its Go runtime's wake-ups after it) is over when the run starts.
const settle = 10 * time.Millisecond

// observe runs fn, a case moving the bytes it returns, and adds what
// the contender's daemon did meanwhile to the case's usage: for tensorfs
// its requests and CPU time from user.tensorfs.stats (the CPU the stats
// read itself costs, a walk of the backing tree, is measured by a second
// read and taken off), for loopbackfs its CPU time from /proc. Warm-up
// runs are not counted.
func (b *bench) observe(c *contender, caseName string, fn func() (int64, error)) error {
	if c.pid == 0 || b.res.warming {
		time.Sleep(settle)
		_, err := fn()
		return err
	}
	var before, after, again daemonStats
	var err error
	if before, err = c.counters(); err != nil {
		return err
	}
	time.Sleep(settle)
	moved, err := fn()
	if err != nil {
		return err
	}
	if after, err = c.counters(); err != nil {
		return err
	}
	if c.tensorfs {
		if again, err = c.counters(); err != nil {
			return err
		}
	} else {
		again = after
	}
	k := usageKey{caseName, c.name}
	u := b.res.usage[k]
	if u == nil {
		u = &usage{requests: map[string]int64{}, counted: c.tensorfs}
		b.res.usage[k] = u
		b.res.order = append(b.res.order, k)
	}
	u.runs++
	u.bytes += moved
	for op, n := range after.Requests {
		d := n - before.Requests[op]
		if op == "GETXATTR" {
			d-- // the read of the stats that ended the case
		}
		if d != 0 {
			u.requests[op] += d
		}
	}
	cpu := (after.Daemon.CPUSeconds - before.Daemon.CPUSeconds) - (again.Daemon.CPUSeconds - after.Daemon.CPUSeconds)
	u.cpu += max(cpu, 0)
	return nil
}
