// Package ledger is the one account of what the daemon holds on behalf of
// requests (DESIGN.md §9, "One ledger"). Each kind of resource a request
// can make the daemon hold (descriptors, pidfds, blocked threads,
// connections, counters, published entries and bytes, ...) is a Row,
// charged to the uid whose request made the daemon hold it and given back
// when the resource is released. Every row is bounded per uid and in
// total, and an eighth of every total is root's alone: users other than
// root, however many, never take all of a row.
package ledger

import (
	"fmt"
	"slices"
	"sync"
	"syscall"
)

// Ledger holds a daemon's rows. Its zero value is not usable: use New.
type Ledger struct {
	mu   sync.Mutex
	rows []*Row
}

// New returns an empty ledger.
func New() *Ledger { return &Ledger{} }

// Spec describes a row: what it counts and its bounds.
type Spec struct {
	// Name says what is counted, in refusals and in the mount's
	// statistics ("descriptors", "blocked threads").
	Name string
	// Unit is what one counts ("descriptor", "byte").
	Unit string
	// PerUID is the most one user other than root may hold; Total the
	// most all users together may.
	PerUID, Total int64
	// Over is the errno of a refusal because the user holds its share
	// (EMFILE for descriptors, EDQUOT for bytes); Full that of a refusal
	// because the daemon holds its total or users other than root hold
	// all but root's reserve (ENFILE, ENOSPC). Zero means EAGAIN.
	Over, Full syscall.Errno
}

// Row counts one resource per uid against its bounds.
type Row struct {
	spec   Spec
	shared int64 // Total less root's eighth: for users other than root

	mu     sync.Mutex
	used   map[uint32]int64
	all    int64
	others int64 // the part of all held by users other than root
	peak   int64
	drift  int64 // given back beyond what was held: a caller's bug
}

// Share is the bound per uid that the daemon's rows default to: an eighth
// of what root's reserve leaves of total, so that at least eight users fit.
func Share(total int64) int64 { return (total - total/8) / 8 }

// Row adds a row to l. Each name is added once.
func (l *Ledger) Row(s Spec) *Row {
	if s.Over == 0 {
		s.Over = syscall.EAGAIN
	}
	if s.Full == 0 {
		s.Full = syscall.EAGAIN
	}
	r := &Row{spec: s, shared: s.Total - s.Total/8, used: map[uint32]int64{}}
	l.mu.Lock()
	defer l.mu.Unlock()
	if slices.ContainsFunc(l.rows, func(o *Row) bool { return o.spec.Name == s.Name }) {
		panic("ledger: row " + s.Name + " added twice")
	}
	l.rows = append(l.rows, r)
	return r
}

// Spec returns what r counts and its bounds.
func (r *Row) Spec() Spec { return r.spec }

// Reserve returns the part of the total that is root's alone.
func (r *Row) Reserve() int64 { return r.spec.Total - r.shared }

// Scope says which bound refused a take.
type Scope string

const (
	// PerUID is one user's share.
	PerUID Scope = "per uid"
	// Others is the total less root's reserve, for users other than root.
	Others Scope = "for users other than root"
	// All is the total, for all users.
	All Scope = "for all users"
)

// Refusal is Take's error: which bound refused which uid.
type Refusal struct {
	Errno syscall.Errno
	Row   string // the row's name
	UID   uint32
	Limit int64 // the bound reached
	Scope Scope
}

func (e *Refusal) Error() string {
	return fmt.Sprintf("uid %d reached the limit of %d %s %s", e.UID, e.Limit, e.Row, e.Scope)
}

// Unwrap makes errors.Is(err, syscall.EMFILE) and the like work.
func (e *Refusal) Unwrap() error { return e.Errno }

// Take charges n more to uid, or refuses with a *Refusal: Over when uid
// would hold more than its share, Full when all users would hold more
// than the total or, for a uid other than root, when such users would
// hold more than all but root's reserve. A refusal changes nothing.
func (r *Row) Take(uid uint32, n int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.spec
	refuse := func(errno syscall.Errno, limit int64, scope Scope) error {
		return &Refusal{Errno: errno, Row: s.Name, UID: uid, Limit: limit, Scope: scope}
	}
	switch {
	case uid != 0 && r.used[uid]+n > s.PerUID:
		return refuse(s.Over, s.PerUID, PerUID)
	case uid != 0 && r.others+n > r.shared:
		return refuse(s.Full, r.shared, Others)
	case r.all+n > s.Total:
		return refuse(s.Full, s.Total, All)
	}
	r.addLocked(uid, n)
	return nil
}

// Add charges n to uid whatever the bounds: for what the daemon holds
// already, such as what it restored at mount.
func (r *Row) Add(uid uint32, n int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.addLocked(uid, n)
}

func (r *Row) addLocked(uid uint32, n int64) {
	r.used[uid] += n
	r.all += n
	if uid != 0 {
		r.others += n
	}
	r.peak = max(r.peak, r.all)
}

// Give returns n of uid's. Giving more than uid holds is a bug of the
// caller's: the row gives back what uid holds and counts the rest as
// drift, which the statistics show, rather than take the daemon down.
func (r *Row) Give(uid uint32, n int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if n > r.used[uid] {
		r.drift += n - r.used[uid]
		n = r.used[uid]
	}
	if r.used[uid] -= n; r.used[uid] == 0 {
		delete(r.used, uid)
	}
	r.all -= n
	if uid != 0 {
		r.others -= n
	}
}

// Held returns what uid holds.
func (r *Row) Held(uid uint32) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.used[uid]
}

// Used returns what all users hold.
func (r *Row) Used() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.all
}

// Usage is a row's state, for the mount's statistics.
type Usage struct {
	Name   string           `json:"name"`
	Unit   string           `json:"unit"`
	PerUID int64            `json:"per_uid"`
	Total  int64            `json:"total"`
	Root   int64            `json:"root_reserve"`
	Used   int64            `json:"used"`
	Peak   int64            `json:"peak"`
	Drift  int64            `json:"drift,omitempty"`
	ByUID  map[uint32]int64 `json:"by_uid,omitempty"`
}

// Usage returns every row's state, in the order the rows were added.
func (l *Ledger) Usage() []Usage {
	l.mu.Lock()
	rows := slices.Clone(l.rows)
	l.mu.Unlock()
	out := make([]Usage, 0, len(rows))
	for _, r := range rows {
		r.mu.Lock()
		u := Usage{Name: r.spec.Name, Unit: r.spec.Unit, PerUID: r.spec.PerUID, Total: r.spec.Total,
			Root: r.Reserve(), Used: r.all, Peak: r.peak, Drift: r.drift}
		if len(r.used) > 0 {
			u.ByUID = make(map[uint32]int64, len(r.used))
			for uid, n := range r.used {
				u.ByUID[uid] = n
			}
		}
		r.mu.Unlock()
		out = append(out, u)
	}
	return out
}
