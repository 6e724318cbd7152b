package integration

// What user.tensorfs.stats tells a user of others (README, Security
// model: no information beyond tmpfs).

import (
	"strings"
	"testing"
)

// statsByUIDScript prints, from the mount root argv[1]'s
// user.tensorfs.stats, what each ledger row says uid argv[2] holds.
const statsByUIDScript = `
import json, os, sys
s = json.loads(os.getxattr(sys.argv[1], "user.tensorfs.stats"))
for r in s.get("ledger", []):
    n = (r.get("by_uid") or {}).get(sys.argv[2])
    if n:
        print(r["name"].split(" ")[0], n)
`

// TestAttackStatsNameUsers (no information beyond tmpfs): user.tensorfs.stats
// is everyone's to read ("it names no segment, directory or user", as df
// and df -i), but its ledger rows list what each uid holds: user A learns
// how many objects user B keeps in a directory only B may list or
// search (0700), and how many segments B has open right now, which no
// tmpfs tells another user.
func TestAttackStatsNameUsers(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, m *mount) {
		userDirs(t, m)
		if out, err := runAs(t, userB, "/", "sh", "-c",
			"umask 077 && mkdir "+m.path("b/private")+" && cd "+m.path("b/private")+" && touch s1 s2 s3 s4 s5 s6 s7"); err != nil {
			t.Fatalf("user B: %v\n%s", err, out)
		}
		out := strings.TrimSpace(pythonAs(t, userA, "/", statsByUIDScript, m.dir, "1001"))
		if out != "" {
			t.Errorf("user A reads from user.tensorfs.stats what uid %d holds (objects in its 0700 directory among them):\n%s", userB, out)
		}
	}, "--allow-other")
}
