package integration

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
)

// inodeFillScript makes objects of every kind in argv[1] until a make is
// refused, and prints how many it made and the refusal's errno name.
const inodeFillScript = `
import errno, os, sys
d, made = sys.argv[1], 0
makers = [lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)),
          os.mkdir, lambda p: os.symlink("x", p), os.mkfifo]
try:
    while made < 100000:
        makers[made % 4](os.path.join(d, "o%d" % made))
        made += 1
    print(made, "none")
except OSError as e:
    print(made, errno.errorcode[e.errno])
`

// TestInodesPerUser (ledger row "inodes"): a user who makes objects of
// every kind stops at its share of the backing's inodes with EDQUOT; the
// refused make leaves nothing; another user and root still make theirs;
// a removal gives a place back; the mount's statistics show the charge.
func TestInodesPerUser(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m) // a and b, made by root and given to A and B: charged to them
		const share = 512 / 16
		out := strings.Fields(pythonAs(t, userA, "/", inodeFillScript, m.path("a")))
		if len(out) != 2 || out[1] != "EDQUOT" || out[0] != fmt.Sprint(share-1) {
			t.Fatalf("user A made %v objects before a refusal, want %d and EDQUOT (its share of 512 inodes, its directory included)", out, share-1)
		}
		if _, err := os.Lstat(m.path(fmt.Sprintf("a/o%d", share-1))); !os.IsNotExist(err) {
			t.Errorf("the refused make left its name: %v", err)
		}
		if out, err := runAs(t, userB, "/", "mkdir", m.path("b/mine")); err != nil {
			t.Errorf("user B, while A holds its share: %v\n%s", err, out)
		}
		if err := os.Mkdir(m.path("roots"), 0o755); err != nil {
			t.Errorf("root, while A holds its share: %v", err)
		}
		if out, err := runAs(t, userA, "/", "rm", m.path("a/o0")); err != nil {
			t.Fatalf("rm: %v\n%s", err, out)
		}
		if out, err := runAs(t, userA, "/", "touch", m.path("a/again")); err != nil {
			t.Errorf("user A after a removal: %v\n%s", err, out)
		}
		if got := ledgerHeld(t, m, "inodes", userA); got != share {
			t.Errorf("the ledger charges user A %d inodes, want %d", got, share)
		}
		// A user sees what it holds itself, and no other uid.
		seen := pythonAs(t, userA, "/", `
import json, os, sys
for r in json.loads(os.getxattr(sys.argv[1], "user.tensorfs.stats"))["ledger"]:
    print(" ".join(sorted((r.get("by_uid") or {}).keys())))`, m.dir)
		for _, line := range strings.Split(strings.TrimSpace(seen), "\n") {
			if line != "" && line != fmt.Sprint(userA) {
				t.Errorf("user A's user.tensorfs.stats names uids %q, want only its own", line)
			}
		}
		wantLog(t, m, "refused", fmt.Sprintf("uid %d reached the limit of %d inodes", userA, share))
	}, "--allow-other", "--inodes", "512")
}

// ledgerHeld returns what uid holds in the mount's ledger row whose name
// starts with row, from user.tensorfs.stats.
func ledgerHeld(t *testing.T, m *mount, row string, uid int) int64 {
	t.Helper()
	raw, err := json.Marshal(m.stats(t)["ledger"])
	if err != nil {
		t.Fatal(err)
	}
	var rows []struct {
		Name  string           `json:"name"`
		ByUID map[string]int64 `json:"by_uid"`
	}
	if err := json.Unmarshal(raw, &rows); err != nil {
		t.Fatalf("stats' ledger: %v\n%s", err, raw)
	}
	for _, r := range rows {
		if strings.HasPrefix(r.Name, row) {
			return r.ByUID[fmt.Sprint(uid)]
		}
	}
	t.Fatalf("stats' ledger has no row %q: %s", row, raw)
	return 0
}
