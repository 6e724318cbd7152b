package fs

import (
	"context"
	"fmt"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// handleBudget bounds the backing descriptors that open segments keep in
// the daemon (one each), per uid and in total, so that no user can take
// the descriptors that serve everyone else. Root is bound by the total
// only. The control socket has the other half of the daemon's open-file
// limit (package ctl).
type handleBudget struct {
	perUID, total int

	mu   sync.Mutex
	used map[uint32]int
	all  int
}

// newHandleBudget sizes the budget from the daemon's open-file limit:
// half of it, less a reserve for directories and the daemon's own files,
// and a quarter of that for one user.
func newHandleBudget() *handleBudget {
	limit := 1024
	var r unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &r) == nil {
		limit = int(min(r.Cur, 1<<30))
	}
	total := max(limit/2-256, 64)
	return &handleBudget{perUID: max(total/4, 16), total: total, used: map[uint32]int{}}
}

// take counts a new open handle of uid, or refuses it: EMFILE when uid
// holds its share, ENFILE when the daemon holds its total.
func (b *handleBudget) take(uid uint32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.all >= b.total:
		return fmt.Errorf("%w: the daemon holds %d open segments, the most it serves at once", syscall.ENFILE, b.all)
	case uid != 0 && b.used[uid] >= b.perUID:
		return fmt.Errorf("%w: uid %d holds %d open segments, the most one user may", syscall.EMFILE, uid, b.perUID)
	}
	b.used[uid]++
	b.all++
	return nil
}

// give returns a handle of uid.
func (b *handleBudget) give(uid uint32) {
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
