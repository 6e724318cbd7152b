package main

import (
	"fmt"
	"os"
	"strings"
	"time"

	"tensorfs/cluster/sim"
)

// The sim group: the piece scheduler of package cluster on simulated
// clusters (package cluster/sim), from one node pulling alone to
// cfg.simNodes nodes pulling at once, each size as it is, with churn
// (simLate of the nodes starting late and simDie dying mid-pull), with
// etcd keeping membership only (sim.Config.Membership), and so with the
// seeder super-seeding (sim.Config.SuperSeed). No root, mount or network:
// it runs on a virtual clock.

// Churn of the sim group's second run at each size.
const (
	simLate = 0.1
	simDie  = 0.05
)

// groupSim runs the simulations and keeps their table for the report.
func (b *bench) groupSim() error {
	start := time.Now()
	one, rs := sim.Sweep(b.cfg.simNodes, simLate, simDie)
	fmt.Fprintf(os.Stderr, "bench: sim: %d runs in %s\n", 1+len(rs), time.Since(start).Round(time.Second))
	b.simTable = sim.Table(one, append([]sim.Result{one}, rs...))
	fmt.Fprint(os.Stderr, b.simTable)
	return nil
}

// writeSim writes the sim group's section of the report.
func (b *bench) writeSim(w *strings.Builder) {
	if b.simTable == "" {
		return
	}
	c := sim.Defaults(1)
	fmt.Fprintf(w, "\n## Cluster simulation\n\nThe scheduler of `tensorfs pull` (package cluster: which piece next, from which holder) "+
		"on simulated clusters (package cluster/sim, a virtual clock; regenerate with `make bench-sim`): one seeder holds a model of %s "+
		"in %d files of %s pieces; N nodes pull it at once over links of %.0f Mbit/s up and down with %v latency, etcd answering "+
		"in %v; each size again with %.0f%% of the nodes starting late (within half a pull) and %.0f%% dying mid-pull; "+
		"the first row is one node pulling alone. etcd's load is what the code writes: a transaction per batch of changed holder keys, "+
		"each key a watch event at every node pulling the content; the rows whose etcd keeps membership simulate the design of DESIGN.md §10 "+
		"that the code does not have yet (a key per node per content written when its pull starts and ends; a puller learns the pieces of "+
		"up to 32 pulling nodes from them, over the transport), and with super-seeding: the seeder sends each piece once before it sends any twice "+
		"(asked for a piece, it sends the one it has sent least of those the asker lacks).\n\n",
		fmtSize(c.Model), c.Files, fmtSize(c.PieceSize), c.Up*8/1e6, c.Latency, c.Etcd, 100*simLate, 100*simDie)
	w.WriteString(b.simTable)
}
