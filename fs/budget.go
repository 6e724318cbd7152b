package fs

import (
	"context"
	"fmt"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// budget bounds something each user can make the daemon hold, per uid
// and in total, so that no user can take what serves everyone else: the
// backing descriptors of open segments (one each; the control socket has
// the other half of the daemon's open-file limit, package ctl), and GPU
// consumer counters. Root is bound by the total only.
type budget struct {
	// what names the things counted, in refusals ("open segments").
	what          string
	perUID, total int

	mu   sync.Mutex
	used map[uint32]int
	all  int
}

// newBudget bounds what: perUID for one user, total for all.
func newBudget(what string, perUID, total int) *budget {
	return &budget{what: what, perUID: perUID, total: total, used: map[uint32]int{}}
}

// newHandleBudget sizes the open segments' budget from the daemon's
// open-file limit: half of it, less a reserve for directories and the
// daemon's own files, and a quarter of that for one user.
func newHandleBudget() *budget {
	limit := 1024
	var r unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &r) == nil {
		limit = int(min(r.Cur, 1<<30))
	}
	total := max(limit/2-256, 64)
	return newBudget("open segments", max(total/4, 16), total)
}

// take counts a new one of uid, or refuses it: EMFILE when uid holds its
// share, ENFILE when the daemon holds its total.
func (b *budget) take(uid uint32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.all >= b.total:
		return fmt.Errorf("%w: the daemon holds %d %s, the most it keeps at once", syscall.ENFILE, b.all, b.what)
	case uid != 0 && b.used[uid] >= b.perUID:
		return fmt.Errorf("%w: uid %d holds %d %s, the most one user may", syscall.EMFILE, uid, b.perUID, b.what)
	}
	b.used[uid]++
	b.all++
	return nil
}

// give returns one of uid.
func (b *budget) give(uid uint32) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.used[uid]--; b.used[uid] <= 0 {
		delete(b.used, uid)
	}
	b.all--
}

// takeHandle takes a handle from the caller's budget for open, which
// makes one (newHandle) or fails; a failed open gives it back.
func (fsys *filesystem) takeHandle(ctx context.Context, open func() error) error {
	uid := caller(ctx).Uid
	if err := fsys.handles.take(uid); err != nil {
		return err
	}
	err := open()
	if err != nil {
		fsys.handles.give(uid)
	}
	return err
}
