package fs

import (
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// stuckFS answers GETATTR of node 2 only once release is closed.
type stuckFS struct {
	fuse.RawFileSystem
	started chan struct{}
	release chan struct{}
}

func (f *stuckFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	if in.NodeId == 2 {
		close(f.started)
		<-f.release
	}
	return fuse.OK
}

func getattr(g *gateFS, node uint64) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		in := &fuse.GetAttrIn{}
		in.NodeId = node
		g.GetAttr(nil, in, &fuse.AttrOut{})
		close(done)
	}()
	return done
}

// TestAttackGateRefusedFreeze: a handover (tensorfs restart) whose freeze
// times out on a request in flight (a user's open of a segment still
// being pulled waits for the whole pull) must hold nothing off after it
// is refused. With a sync.RWMutex, the timed-out Lock stayed queued, and
// every later request of every user waited for the slow one to finish.
func TestAttackGateRefusedFreeze(t *testing.T) {
	raw := &stuckFS{RawFileSystem: fuse.NewDefaultRawFileSystem(), started: make(chan struct{}), release: make(chan struct{})}
	g := &gateFS{RawFileSystem: raw}
	slow := getattr(g, 2)
	<-raw.started
	if g.freeze(100 * time.Millisecond) {
		t.Fatal("freeze succeeded with a request in flight")
	}
	select {
	case <-getattr(g, 1):
	case <-time.After(2 * time.Second):
		close(raw.release)
		t.Fatal("a request after a refused freeze waits for the request in flight")
	}
	close(raw.release)
	<-slow

	// A freeze that succeeds holds requests off until thawed.
	if !g.freeze(time.Second) {
		t.Fatal("freeze with nothing in flight failed")
	}
	held := getattr(g, 1)
	select {
	case <-held:
		t.Fatal("a request went on while frozen")
	case <-time.After(100 * time.Millisecond):
	}
	g.thaw()
	select {
	case <-held:
	case <-time.After(2 * time.Second):
		t.Fatal("a request held off by a freeze did not go on after thaw")
	}
	// Again, many requests at once around freezes.
	for i := 0; i < 50; i++ {
		var dones []<-chan struct{}
		for j := 0; j < 20; j++ {
			dones = append(dones, getattr(g, 1))
		}
		if g.freeze(time.Second) {
			g.thaw()
		} else {
			t.Fatal("freeze failed with only quick requests in flight")
		}
		for _, d := range dones {
			<-d
		}
	}
}
