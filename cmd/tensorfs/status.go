package main

// tensorfs status [--json] [MOUNTPOINT...]: each mount's state, from its
// root's user.tensorfs.stats, as a table for people or JSON for scripts;
// and tensorfs --version.

import (
	"debug/buildinfo"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"runtime/debug"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
)

// mountStats is the part of user.tensorfs.stats that status shows; Raw
// keeps all of it for --json.
type mountStats struct {
	Mode      string                `json:"mode"`
	HugePages bool                  `json:"huge_pages"`
	Segments  int64                 `json:"segments"`
	Bytes     int64                 `json:"bytes"`
	Capacity  int64                 `json:"capacity"`
	Used      int64                 `json:"used"`
	Limbo     struct{ Bytes int64 } `json:"limbo"`
	Requests  map[string]int64      `json:"requests"`
	Cluster   *struct {
		Node      string `json:"node"`
		Addr      string `json:"addr"`
		NotJoined string `json:"not_joined"` // why the node is not joined, if it is not
	} `json:"cluster"`
	Daemon struct {
		Pid      int   `json:"pid"`
		RSSBytes int64 `json:"rss_bytes"`
	} `json:"daemon"`
}

// statusReport is one mount's line of tensorfs status --json.
type statusReport struct {
	Mountpoint string          `json:"mountpoint"`
	Version    string          `json:"daemon_version,omitempty"` // "" when its binary cannot be read
	Stats      json.RawMessage `json:"stats,omitempty"`
	Error      string          `json:"error,omitempty"`
	stats      mountStats
	unmounted  bool // the path is gone, or no tensorfs mount
}

func runStatus(args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs status", flag.ContinueOnError)
	asJSON := set.Bool("json", false, "print a JSON array, one object per mount, with the whole of user.tensorfs.stats")
	if code, ok := parseFlags(set, args, "[--json] [MOUNTPOINT...]   (every tensorfs mount when none is named)", stdout, stderr); !ok {
		return code
	}
	points := set.Args()
	if len(points) == 0 {
		var err error
		if points, err = tensorfsMounts(); err != nil {
			fmt.Fprintf(stderr, "tensorfs status: %v\n", err)
			return 1
		}
	}
	status := 0
	reports := make([]statusReport, 0, len(points))
	for _, r := range readStatuses(points, statusWait) {
		if r.unmounted && set.NArg() == 0 {
			continue // unmounted since the table was read
		}
		if r.Error != "" {
			status = 1
			if !*asJSON {
				fmt.Fprintf(stderr, "tensorfs status: %s\n", alloc.EscapeText(r.Error))
				continue
			}
		}
		reports = append(reports, r)
	}
	if *asJSON {
		b, _ := json.MarshalIndent(reports, "", "  ")
		fmt.Fprintf(stdout, "%s\n", b)
		return status
	}
	if len(points) == 0 {
		fmt.Fprintln(stdout, "no tensorfs mounts (tensorfs mount MOUNTPOINT makes one)")
		return status
	}
	if len(reports) > 0 {
		writeStatusTable(stdout, reports)
	}
	return status
}

// statusWait bounds how long status waits for the daemons' answers: one
// that hangs must not hang the report on every other mount.
const statusWait = 5 * time.Second

// readStatuses reads every mount's statistics at once; a mount whose
// daemon has not answered within wait is reported as not answering (its
// read is left behind).
func readStatuses(points []string, wait time.Duration) []statusReport {
	answers := make([]chan statusReport, len(points))
	for i, p := range points {
		answers[i] = make(chan statusReport, 1)
		go func() { answers[i] <- readStatus(p) }()
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	expired := false
	reports := make([]statusReport, len(points))
	for i, p := range points {
		if !expired {
			select {
			case reports[i] = <-answers[i]:
				continue
			case <-timer.C:
				expired = true // the others had as long
			}
		}
		select {
		case reports[i] = <-answers[i]:
		default:
			reports[i] = statusReport{Mountpoint: p, Error: fmt.Sprintf("%s: its daemon did not answer within %v (busy or hung; see its log, or unmount it)", p, wait)}
		}
	}
	return reports
}

// readStatus reads the statistics of the mount at point.
func readStatus(point string) statusReport {
	r := statusReport{Mountpoint: point}
	raw, ok, err := alloc.GetXattr(point, alloc.AttrStats)
	switch {
	case errors.Is(err, unix.ENOTCONN):
		r.Error = fmt.Sprintf("%s: the tensorfs daemon is gone (%v): remount it with tensorfs mount", point, err)
	case err == nil && !ok, errors.Is(err, unix.ENOTSUP):
		if cerr := checkInside(point); cerr != nil {
			r.Error, r.unmounted = cerr.Error(), true
		} else {
			r.Error = fmt.Sprintf("%s is in a tensorfs mount but not its root: name the mount point", point)
		}
	case err != nil:
		r.Error, r.unmounted = fmt.Sprintf("%s: %v", point, err), errors.Is(err, unix.ENOENT)
	default:
		if err := json.Unmarshal(raw, &r.stats); err != nil {
			r.Error = fmt.Sprintf("%s: %s is not what tensorfs writes: %v", point, alloc.AttrStats, err)
			break
		}
		r.Stats = raw
		if bi, err := buildinfo.ReadFile(fmt.Sprintf("/proc/%d/exe", r.stats.Daemon.Pid)); err == nil {
			r.Version = shortVersion(bi)
		}
	}
	return r
}

// writeStatusTable prints one row per mount.
func writeStatusTable(w io.Writer, reports []statusReport) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MOUNTPOINT\tMODE\tUSED\tCAPACITY\tSEGMENTS\tLIMBO\tREQUESTS\tDAEMON\tRSS\tVERSION\tCLUSTER")
	for _, r := range reports {
		s := r.stats
		var requests int64
		for _, n := range s.Requests {
			requests += n
		}
		cluster := "-"
		if s.Cluster != nil {
			cluster = s.Cluster.Node + " (" + s.Cluster.Addr + ")"
			if s.Cluster.NotJoined != "" {
				cluster += " not joined"
			}
		}
		mode := s.Mode
		if s.HugePages {
			mode += ", huge pages"
		}
		version := r.Version
		if version == "" {
			version = "-"
		}
		row := []string{alloc.Escape(r.Mountpoint), alloc.EscapeText(mode), humanSize(s.Used), humanSize(s.Capacity),
			strconv.FormatInt(s.Segments, 10), humanSize(s.Limbo.Bytes), strconv.FormatInt(requests, 10),
			strconv.Itoa(s.Daemon.Pid), humanSize(s.Daemon.RSSBytes), alloc.EscapeText(version), alloc.EscapeText(cluster)}
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	tw.Flush()
}

// runVersion prints the version of this binary: its module version, the
// commit it was built from, and the Go release.
func runVersion(stdout, stderr io.Writer) int {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		fmt.Fprintln(stderr, "tensorfs: no build information in this binary")
		return 1
	}
	commit := "commit unknown (built with -buildvcs=false or outside git)"
	if rev, modified := vcsRevision(bi); rev != "" {
		commit = "commit " + rev
		if modified {
			commit += " (modified)"
		}
	}
	fmt.Fprintf(stdout, "tensorfs %s, %s, %s\n", bi.Main.Version, commit, bi.GoVersion)
	return 0
}

// shortVersion is "VERSION" or "VERSION REV12", with "+" when the tree
// had changes, for a table.
func shortVersion(bi *debug.BuildInfo) string {
	rev, modified := vcsRevision(bi)
	v := bi.Main.Version
	if rev != "" {
		v += " " + rev[:min(12, len(rev))]
	}
	if modified {
		v += "+"
	}
	return v
}

// vcsRevision returns the commit a binary was built from ("" when not
// stamped) and whether its tree had changes.
func vcsRevision(bi *debug.BuildInfo) (rev string, modified bool) {
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	return rev, modified
}
