package integration

import (
	"os"
	"testing"
)

// TestLoadAttrsChangedByWriter: a daemon whose kernel knows no node of a
// segment (after a remount) keeps what a load read of its tensor
// attributes for the next loads (fs.storedAttrs). A writer who is not the
// owner changes them behind the daemon, with fsetxattr on the descriptor a
// load handed out: the next load serves what is stored now, a valid value
// as it is and an invalid one not at all, never the attributes it kept.
func TestLoadAttrsChangedByWriter(t *testing.T) {
	t.Parallel()
	m := attackMount(t, "passthrough", true) // the socket does not depend on the mode
	teamKeepFD(t, m, "0123456789abcdef")
	w := m.path("shared/team/w")
	if out, err := runAs(t, userB, "/", "sh", "-c", "setfattr -n user.tensor.dtype -v float32 "+w+" && setfattr -n user.tensor.shape -v '[4]' "+w); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if err := os.Remove(m.path("shared/team/e")); err != nil { // w's descriptor is the first
		t.Fatal(err)
	}
	m.unmount(t, false)
	m = m.remount(t)
	sock := controlSocket(t, m)
	load := map[string]any{"v": 1, "op": "load", "path": "shared/team", "write": true}
	shape := func(got forgeResult) string {
		if len(got.Reply.Segments) != 1 {
			t.Fatalf("load lists %d segments, want w alone", len(got.Reply.Segments))
		}
		return got.Reply.Segments[0].Shape
	}
	for _, step := range []struct{ set, want string }{
		{"[2, 2]", "[4]"}, // the first load reads storage, then the writer sets a valid shape
		{"[[4", "[2, 2]"}, // the writer's shape, then one the mount refuses
		{"[4]", ""},       // the refused value is left out, then the owner's again
		{"[4]", "[4]"},    // and served
	} {
		got := forge(t, userA, sock, load, [][2]string{{"user.tensor.shape", step.set}})
		if s := shape(got); s != step.want {
			t.Errorf("load by uid %d serves shape %q, want %q (what is stored)", userA, s, step.want)
		}
		if got.Set["user.tensor.shape"] != 0 {
			t.Fatalf("uid %d fsetxattr user.tensor.shape %q through its descriptor: errno %d", userA, step.set, got.Set["user.tensor.shape"])
		}
	}
}
