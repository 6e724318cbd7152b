package sim

import (
	"testing"
	"time"
)

// TestSim runs the real scheduler on small simulated clusters: every node
// that does not die gets the model, soon after one node alone would; the
// seeder sends it less than twice; each node writes about one holder key
// per piece it gets, however many nodes pull.
func TestSim(t *testing.T) {
	one := Run(Defaults(1))
	ideal := Defaults(1).Ideal()
	if one.Completed != 1 || one.Done < ideal || one.Done > ideal*11/10 || one.Seeded != 1 {
		t.Fatalf("one node alone: %v; want the model in about %v, sent once", one, ideal)
	}
	var perNode []float64
	for _, n := range []int{8, 24} {
		cfg := Defaults(n)
		cfg.Late, cfg.Die = 0.2, 0.1
		r := Run(cfg)
		t.Log(r)
		if r.Completed+r.Died != n || r.Completed == 0 {
			t.Fatalf("%d nodes: %v; every node that did not die should complete", n, r)
		}
		if r.Slowest > 2*one.Done || r.Seeded > 2 {
			t.Errorf("%d nodes: %v; want every pull within twice one node's alone (%v), the seeder sending under 2 models", n, r, one.Done)
		}
		if want := (r.Nodes - r.Died + 1) * r.Files; r.HolderKeys != want {
			t.Errorf("%d nodes: %d holder keys, want %d: one per live node per content", n, r.HolderKeys, want)
		}
		if r.Died > 0 && r.Failed == 0 {
			t.Errorf("%d nodes: %d died and no fetch failed", n, r.Died)
		}
		perNode = append(perNode, r.PerNodePiece(r.Puts))
		// Each write reaches every node pulling then: at most one event
		// per pulling node per key written.
		if r.Events > r.Puts*int64(n) || r.Events < r.Puts {
			t.Errorf("%d nodes: %d watch events for %d keys written", n, r.Events, r.Puts)
		}
	}
	for _, w := range perNode {
		if w < 0.5 || w > 1.5 { // the nodes that died wrote less
			t.Errorf("keys written per node per piece: %v; want about one, whatever the number of nodes", perNode)
		}
	}
}

// TestSimDeterministicLinks checks the network model on two nodes: one
// seeder, one puller, pieces that fit the link: the pull takes the
// model's bytes over the link's rate, plus latencies.
func TestSimDeterministicLinks(t *testing.T) {
	cfg := Defaults(1)
	cfg.Down = cfg.Up / 2
	r := Run(cfg)
	if want := cfg.Ideal(); r.Done < want || r.Done > want+time.Second {
		t.Fatalf("a pull at half the seeder's rate: %v, want about %v", r.Done, want)
	}
}
