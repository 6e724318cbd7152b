package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The cluster group: a model imported with tensorfs import on node1 of a
// scripts/cluster.sh test bed (1 Gbit/s links, one network namespace per
// node, etcd in another), published, and pulled by the other nodes'
// daemons with tensorfs pull, or fetched by tensorfs.load_into.

var (
	mLinkRate   = metricDef{"transfer between node1 and node2", "Gbit/s", true}
	mPullTime   = metricDef{"pull of the model", "s", false}
	mUpload     = metricDef{"node1's upload while the nodes pull", "× model", false}
	mCPUPulled  = metricDef{"puller's daemon CPU per GiB pulled", "s", false}
	mCPUServed  = metricDef{"holders' daemons' CPU per GiB served", "s", false}
	mCPUCores   = metricDef{"all daemons' CPU while the nodes pull", "cores", false}
	mPulledRead = metricDef{"read of every tensor of the model", "GiB/s", true}
)

// Contenders of the cluster group, as the report's columns.
const (
	iperfName  = "iperf3"
	oneName    = "1 node"
	loadName   = "1 node, load_into"
	fourName   = "4 nodes at once"
	eightName  = "8 nodes at once"
	seedsName  = "1 node, 8 holders"
	killedName = "1 node, a holder killed"
	pulledName = "pulled"
)

// clusterNodes is the test bed's size: a publisher and eight pullers.
const clusterNodes = 9

// clusterBed is the test bed the group runs on.
type clusterBed struct {
	b      *bench
	dir    string
	script string
	bin    string // the tensorfs binary the daemons run
}

// groupCluster measures, round by round: iperf3 between node1 and node2
// against node2 pulling the model (and the CPU its daemon and the
// holders' daemons spent); node2 fetching it by tensorfs.load_into
// instead, from the same holders; four and then eight nodes pulling it at
// once (their time, node1's upload from its network counters, and the
// CPU all the daemons spent, in cores, as for one pull); one
// node pulling it from eight holders, and again with one of them killed a
// third of the way through (the time lost); and reads of every tensor of
// the model once pulled, against a copy on tmpfs. A node starts every
// pull empty (tensorfs unmount --purge, then mount again).
func (b *bench) groupCluster() error {
	bed, err := b.upCluster()
	if err != nil {
		return err
	}
	defer bed.down()
	src := filepath.Join(b.work, "cluster.safetensors")
	if _, err := writeSafetensors(src, b.cfg.clusterSize); err != nil {
		return err
	}
	defer os.Remove(src)
	n1 := bed.node(1)
	if out, err := exec.Command(b.bin, "import", src, filepath.Join(n1, "model")).CombinedOutput(); err != nil {
		return fmt.Errorf("import: %v\n%s", err, out)
	}
	os.Remove(src)
	out, err := exec.Command(b.bin, "publish", filepath.Join(n1, "model")).CombinedOutput()
	if err != nil {
		return fmt.Errorf("publish: %v\n%s", err, out)
	}
	version := strings.TrimSpace(string(out[strings.LastIndexByte(string(out), ' ')+1:]))
	copyDir := filepath.Join(b.tmpfs, "model")
	if out, err := exec.Command("cp", "-r", filepath.Join(n1, "model"), copyDir).CombinedOutput(); err != nil {
		return fmt.Errorf("cp: %v\n%s", err, out)
	}
	defer os.RemoveAll(copyDir)
	model, err := dirBytes(copyDir)
	if err != nil {
		return err
	}
	b.res.facts = append(b.res.facts, fmt.Sprintf("Cluster: a safetensors file of %s in %d tensors, imported with tensorfs import "+
		"on node1 of a %d-node test bed (scripts/cluster.sh, 1 Gbit/s links shaped with tc, one network namespace per node), "+
		"published with tensorfs publish, pulled with tensorfs pull; every case of a round in the order of the table's columns.",
		fmtSize(model), importTensors, clusterNodes))
	for round := range b.cfg.rounds {
		fmt.Fprintf(os.Stderr, "bench: cluster round %d\n", round+1)
		if err := bed.round(version, model, copyDir); err != nil {
			return err
		}
	}
	lost := b.medianOr0(mPullTime, killedName) - b.medianOr0(mPullTime, seedsName)
	b.res.facts = append(b.res.facts, fmt.Sprintf("Cluster: a holder killed a third of the way through a pull from 8 holders "+
		"cost %.2f s (medians: %s s against %s s with all alive).", lost, fmtNum(b.medianOr0(mPullTime, killedName)),
		fmtNum(b.medianOr0(mPullTime, seedsName))))
	return nil
}

// round runs one round of every cluster case.
func (bed *clusterBed) round(version string, model int64, copyDir string) error {
	b := bed.b
	gbit := func(secs float64) float64 { return float64(model) * 8 / secs / 1e9 }
	rate, err := bed.iperf()
	if err != nil {
		return err
	}
	b.res.add(mLinkRate, iperfName, rate)

	gib := float64(model) / giB
	for _, c := range []struct {
		name string
		ks   []int
	}{{oneName, []int{2}}, {fourName, []int{2, 3, 4, 5}}, {eightName, []int{2, 3, 4, 5, 6, 7, 8, 9}}} {
		secs, upload, cpu, err := bed.fanOut(version, c.ks)
		if err != nil {
			return err
		}
		var all float64
		for _, s := range cpu {
			all += s
		}
		b.res.add(mPullTime, c.name, secs)
		b.res.add(mCPUCores, c.name, all/secs)
		if c.name != oneName {
			b.res.add(mUpload, c.name, float64(upload)/float64(model))
			continue
		}
		b.res.add(mLinkRate, oneName, gbit(secs))
		b.res.add(mCPUPulled, oneName, cpu[2]/gib)
		b.res.add(mCPUServed, oneName, (all-cpu[2])/gib)
		// load_into on the same node, from the same holders.
		if secs, err = bed.loadInto(2, version); err != nil {
			return err
		}
		b.res.add(mPullTime, loadName, secs)
	}

	// node1 and nodes 2 to 8 hold the model: node9 pulls from eight.
	secs, err := bed.pulls(version, []int{9}, nil)
	if err != nil {
		return err
	}
	b.res.add(mPullTime, seedsName, secs)
	var killed int
	if secs, err = bed.pulls(version, []int{9}, func() (err error) { killed, err = bed.kill(2); return err }); err != nil {
		return err
	}
	b.res.add(mPullTime, killedName, secs)
	if err := bed.awaitSuccessor(2, killed); err != nil { // it recovers what node2 held
		return err
	}

	for _, c := range []struct{ name, dir string }{{tmpfsName, copyDir}, {pulledName, filepath.Join(bed.node(9), "model")}} {
		t := time.Now()
		n, err := readDir(c.dir)
		if err != nil {
			return err
		}
		b.res.add(mPulledRead, c.name, float64(n)/giB/time.Since(t).Seconds())
	}
	return nil
}

// upCluster brings up the test bed, its daemons running the measured
// binary.
func (b *bench) upCluster() (*clusterBed, error) {
	bed := &clusterBed{b: b, dir: filepath.Join(b.work, "cluster"), script: "scripts/cluster.sh", bin: b.bin}
	capacity := strconv.FormatInt(b.cfg.clusterSize/giB*giB+2*giB, 10)
	cmd := exec.Command(bed.script, "up", strconv.Itoa(clusterNodes), bed.dir, "--rate", "1gbit", "--capacity", capacity)
	cmd.Env = append(os.Environ(), "TENSORFS_BIN="+b.bin)
	if out, err := cmd.CombinedOutput(); err != nil {
		exec.Command(bed.script, "down", bed.dir).Run()
		return nil, fmt.Errorf("cluster.sh up (run from the repository root): %v\n%s", err, out)
	}
	return bed, nil
}

// down takes the test bed down.
func (bed *clusterBed) down() {
	if out, err := exec.Command(bed.script, "down", bed.dir).CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "bench: cluster.sh down: %v\n%s", err, out)
	}
}

func (bed *clusterBed) node(k int) string { return filepath.Join(bed.dir, "node"+strconv.Itoa(k)) }

// exec runs a command in node k's network namespace (k 0: etcd's).
func (bed *clusterBed) exec(k int, args ...string) ([]byte, error) {
	return exec.Command(bed.script, append([]string{"exec", bed.dir, "node" + strconv.Itoa(k)}, args...)...).CombinedOutput()
}

// mount mounts node k again (its backing recovered, or a fresh one).
func (bed *clusterBed) mount(k int) error {
	if out, err := exec.Command(bed.script, "mount", bed.dir, strconv.Itoa(k)).CombinedOutput(); err != nil {
		return fmt.Errorf("cluster.sh mount %d: %v\n%s", k, err, out)
	}
	return nil
}

// empty makes node k start over with an empty backing, and waits until
// it shows version of the model.
func (bed *clusterBed) empty(k int, version string) error {
	if out, err := exec.Command(bed.bin, "unmount", "--purge", bed.node(k)).CombinedOutput(); err != nil {
		return fmt.Errorf("unmount node%d: %v\n%s", k, err, out)
	}
	if err := bed.mount(k); err != nil {
		return err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		var a struct{ Version string }
		v, err := getxattr(filepath.Join(bed.node(k), "model"), "user.tensorfs.cluster")
		if err == nil && json.Unmarshal([]byte(v), &a) == nil && a.Version == version {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("node%d does not show the model's version after 30s: %v %s", k, err, v)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// fanOut empties the nodes ks, has them pull the model at once, and
// returns the time until the last is done, node1's upload meanwhile in
// bytes (its network counters), and the CPU seconds each node's daemon
// spent meanwhile, by node.
func (bed *clusterBed) fanOut(version string, ks []int) (float64, int64, map[int]float64, error) {
	for _, k := range ks {
		if err := bed.empty(k, version); err != nil {
			return 0, 0, nil, err
		}
	}
	tx0, err := bed.txBytes(1)
	if err != nil {
		return 0, 0, nil, err
	}
	cpu0, err := bed.cpuTimes()
	if err != nil {
		return 0, 0, nil, err
	}
	secs, err := bed.pullAll(ks, nil)
	if err != nil {
		return 0, 0, nil, err
	}
	cpu, err := bed.cpuTimes()
	if err != nil {
		return 0, 0, nil, err
	}
	tx1, err := bed.txBytes(1)
	if err != nil {
		return 0, 0, nil, err
	}
	for k := range cpu {
		cpu[k] -= cpu0[k]
	}
	return secs, tx1 - tx0, cpu, nil
}

// pulls empties the nodes ks, then has them pull the model at once
// (pullAll).
func (bed *clusterBed) pulls(version string, ks []int, kill func() error) (float64, error) {
	for _, k := range ks {
		if err := bed.empty(k, version); err != nil {
			return 0, err
		}
	}
	return bed.pullAll(ks, kill)
}

// pullAll has the nodes ks pull the model at once and returns the time
// until the last is done. kill, if set, runs once the first node has a
// third of the model.
func (bed *clusterBed) pullAll(ks []int, kill func() error) (float64, error) {
	errs := make([]error, len(ks))
	var wg sync.WaitGroup
	start := time.Now()
	for i, k := range ks {
		wg.Go(func() {
			if out, err := exec.Command(bed.bin, "pull", filepath.Join(bed.node(k), "model")).CombinedOutput(); err != nil {
				errs[i] = fmt.Errorf("node%d: tensorfs pull: %v\n%s", k, err, out)
			}
		})
	}
	if kill != nil {
		if err := bed.awaitThird(ks[0]); err != nil {
			wg.Wait()
			return 0, err
		}
		if err := kill(); err != nil {
			wg.Wait()
			return 0, err
		}
	}
	wg.Wait()
	secs := time.Since(start).Seconds()
	for _, err := range errs {
		if err != nil {
			return 0, err
		}
	}
	return secs, nil
}

// awaitThird waits until node k's pull of the model has a third of it.
func (bed *clusterBed) awaitThird(k int) error {
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		var a struct {
			Pull *struct{ Bytes, Total int64 }
		}
		v, err := getxattr(filepath.Join(bed.node(k), "model"), "user.tensorfs.cluster")
		if err == nil && json.Unmarshal([]byte(v), &a) == nil && a.Pull != nil && a.Pull.Bytes*3 >= a.Pull.Total {
			return nil
		}
		time.Sleep(5 * time.Millisecond)
	}
	return fmt.Errorf("node%d's pull did not reach a third in a minute", k)
}

// loadInto empties node k, then has tensorfs.load_into fetch the model
// there (bench/cluster_load.py) and returns the seconds load_into took.
func (bed *clusterBed) loadInto(k int, version string) (float64, error) {
	if err := bed.empty(k, version); err != nil {
		return 0, err
	}
	pydir, err := filepath.Abs("python")
	if err != nil {
		return 0, err
	}
	big, rest := safetensorsShapes(bed.b.cfg.clusterSize)
	cmd := exec.Command(pythonBin, "bench/cluster_load.py", filepath.Join(bed.node(k), "model"), strconv.Itoa(importTensors-1),
		strconv.FormatInt(big[0], 10), strconv.FormatInt(big[1], 10), strconv.FormatInt(rest[0], 10))
	cmd.Env = append(os.Environ(), "PYTHONPATH="+pydir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("node%d: cluster_load.py: %v\n%s", k, err, out)
	}
	return strconv.ParseFloat(strings.TrimSpace(string(out)), 64)
}

// daemon reads node k's daemon's pid and CPU seconds (user.tensorfs.stats).
func (bed *clusterBed) daemon(k int) (pid int, cpu float64, err error) {
	v, err := getxattr(bed.node(k), "user.tensorfs.stats")
	var st struct {
		Daemon struct {
			Pid        int
			CPUSeconds float64 `json:"cpu_seconds"`
		}
	}
	if err == nil {
		err = json.Unmarshal([]byte(v), &st)
	}
	if err != nil || st.Daemon.Pid == 0 {
		return 0, 0, fmt.Errorf("node%d's daemon: %v", k, err)
	}
	return st.Daemon.Pid, st.Daemon.CPUSeconds, nil
}

// kill SIGKILLs node k's daemon, as a crash, and returns its pid.
func (bed *clusterBed) kill(k int) (int, error) {
	pid, _, err := bed.daemon(k)
	if err != nil {
		return 0, err
	}
	return pid, syscall.Kill(pid, syscall.SIGKILL)
}

// awaitSuccessor waits until node k is served by a daemon other than pid:
// the one its keeper starts when a daemon dies.
func (bed *clusterBed) awaitSuccessor(k, pid int) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		now, _, err := bed.daemon(k)
		if err == nil && now != pid {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("node%d has no new daemon 30 s after its daemon %d was killed: %v", k, pid, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// cpuTimes returns the CPU seconds each node's daemon has spent, by node.
func (bed *clusterBed) cpuTimes() (map[int]float64, error) {
	cpu := map[int]float64{}
	for k := 1; k <= clusterNodes; k++ {
		_, secs, err := bed.daemon(k)
		if err != nil {
			return nil, err
		}
		cpu[k] = secs
	}
	return cpu, nil
}

// iperf measures the link from node2 to node1 with iperf3 (3 s of TCP),
// in Gbit/s. A run that reports no bytes received (iperf3 can say so and
// exit 0) is tried again, twice at most, with a new server.
func (bed *clusterBed) iperf() (float64, error) {
	var err error
	for range 3 {
		var rate float64
		if rate, err = bed.iperfOnce(); err == nil {
			return rate, nil
		}
	}
	return 0, err
}

// iperfOnce is one iperf3 run: a one-off server on node1, a client on
// node2.
func (bed *clusterBed) iperfOnce() (float64, error) {
	server := exec.Command(bed.script, "exec", bed.dir, "node1", "iperf3", "-s", "-1", "-B", "10.99.0.1")
	if err := server.Start(); err != nil {
		return 0, err
	}
	defer func() { // a server that missed its one client would wait forever
		t := time.AfterFunc(5*time.Second, func() { server.Process.Kill() })
		server.Wait()
		t.Stop()
	}()
	var out []byte
	var err error
	for range 50 { // until the server listens
		if out, err = bed.exec(2, "iperf3", "-c", "10.99.0.1", "-t", "3", "-J"); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return 0, fmt.Errorf("iperf3: %v\n%s", err, out)
	}
	var res struct {
		Error string `json:"error"`
		End   struct {
			SumReceived struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
		} `json:"end"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		return 0, fmt.Errorf("iperf3: %v\n%s", err, out)
	}
	if res.Error != "" || res.End.SumReceived.BitsPerSecond <= 0 {
		return 0, fmt.Errorf("iperf3 measured nothing (%s)\n%s", res.Error, out)
	}
	return res.End.SumReceived.BitsPerSecond / 1e9, nil
}

// txBytes reads the bytes node k has sent on its link (/proc/net/dev is
// the reader's network namespace's).
func (bed *clusterBed) txBytes(k int) (int64, error) {
	out, err := bed.exec(k, "cat", "/proc/net/dev")
	if err != nil {
		return 0, fmt.Errorf("node%d /proc/net/dev: %v\n%s", k, err, out)
	}
	for _, line := range strings.Split(string(out), "\n") {
		name, counters, ok := strings.Cut(line, ":")
		if f := strings.Fields(counters); ok && strings.TrimSpace(name) == "eth0" && len(f) >= 9 {
			return strconv.ParseInt(f[8], 10, 64) // receive: 8 fields, then transmit bytes
		}
	}
	return 0, fmt.Errorf("node%d: no eth0 in /proc/net/dev:\n%s", k, out)
}

// dirBytes sums the sizes of the files under dir.
func dirBytes(dir string) (int64, error) {
	var n int64
	err := filepath.Walk(dir, func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
		return err
	})
	return n, err
}

// readDir reads every file under dir and returns the bytes read.
func readDir(dir string) (int64, error) {
	var n int64
	err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil || !fi.Mode().IsRegular() {
			return err
		}
		k, err := readFile(p)
		n += k
		return err
	})
	return n, err
}
