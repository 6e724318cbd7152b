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

// TestSimMembership runs the design in which etcd keeps membership only:
// every node that does not die gets the model; each writes its keys when
// its pull starts and when it ends, whatever the number of pieces; the
// watch events are fewer than with holder keys; what holders tell of
// their pieces over the transport goes to their subscribers only.
func TestSimMembership(t *testing.T) {
	for _, n := range []int{8, 24} {
		cfg := Defaults(n)
		cfg.Late, cfg.Die = 0.2, 0.1
		keys := Run(cfg)
		cfg.Membership = true
		r := Run(cfg)
		t.Log(r)
		if r.Completed+r.Died != n || r.Completed == 0 {
			t.Fatalf("%d nodes: %v; every node that did not die should complete", n, r)
		}
		if r.Txns > int64(2*n) || r.Puts > int64(2*n*r.Files) {
			t.Errorf("%d nodes: %d txns, %d keys written; want at most one txn, of a key per content, at each pull's start and end", n, r.Txns, r.Puts)
		}
		if r.Events >= keys.Events {
			t.Errorf("%d nodes: %d watch events, %d with holder keys; want fewer", n, r.Events, keys.Events)
		}
		if r.Messages == 0 || r.PerNodePiece(r.Messages) > 32 {
			t.Errorf("%d nodes: %d transport messages, %.1f per node per piece; want some, at most 32 (the subscriptions)", n, r.Messages, r.PerNodePiece(r.Messages))
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

// TestSimSuperSeed runs the membership design with complete holders
// super-seeding, a model of one file (a seed chooses among the pieces of
// the content asked for): the seeder sends no piece twice while it has
// not sent every piece once (without, it does, asked for pieces others
// hold by pullers that see 32 of them), every node that does not die
// gets the model, and 32 nodes get it sooner, the seeder sending no more.
func TestSimSuperSeed(t *testing.T) {
	for _, n := range []int{24, 32} {
		cfg := Defaults(n)
		cfg.Membership, cfg.Files = true, 1
		if n == 24 {
			cfg.Late, cfg.Die = 0.2, 0.1
		}
		plain := Run(cfg)
		cfg.SuperSeed = true
		r := Run(cfg)
		t.Logf("%v\n%v", plain, r)
		if r.Completed+r.Died != n || r.Completed == 0 {
			t.Fatalf("%d nodes: %v; every node that did not die should complete", n, r)
		}
		if r.Resent != 0 || plain.Resent == 0 {
			t.Errorf("%d nodes: the seeder sent %d pieces again before it had sent every piece once (%d without super-seeding); want 0 (and some)", n, r.Resent, plain.Resent)
		}
		if n == 32 && (r.Done >= plain.Done || r.Seeded > plain.Seeded) {
			t.Errorf("%d nodes: super-seeding took %v and the seeder sent %.2f models; without, %v and %.2f", n, r.Done, r.Seeded, plain.Done, plain.Seeded)
		}
	}
}
