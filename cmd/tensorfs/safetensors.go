package main

// tensorfs import [--pack-below SIZE] FILE|INDEX|DIR DIR and tensorfs
// export [--max-shard-size SIZE] DIR FILE|DIR: safetensors files and
// sharded checkpoints in and out of a mount (package safetensors/transfer),
// with a progress line on a terminal.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"tensorfs/alloc"
	"tensorfs/safetensors"
	"tensorfs/safetensors/transfer"
)

// progressMin is the smallest copy that gets a progress line.
const progressMin = 64 << 20

func runImport(args []string, stdout, stderr io.Writer) int {
	return runTransfer("import", "[--pack-below SIZE] FILE.safetensors|INDEX.json|CHECKPOINT-DIR DIR   (DIR: new or empty, inside a tensorfs mount)", "into",
		transfer.Import, args, stdout, stderr)
}

func runExport(args []string, stdout, stderr io.Writer) int {
	return runTransfer("export", "[--max-shard-size SIZE] [--tied NAME]... DIR FILE.safetensors|OUT-DIR", "to", transfer.Export, args, stdout, stderr)
}

// runTransfer runs import or export (op) of its two arguments, from and
// to, with a progress line on a terminal, and says what it did: "OPed N
// tensors (SIZE) from FROM INTO TO", with the files and ties when there
// are several files or any tie.
func runTransfer(op, synopsis, into string, do func(ctx context.Context, from, to string, opt transfer.Options) (transfer.Summary, error),
	args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs "+op, flag.ContinueOnError)
	var tied names
	if op == "export" {
		set.String("max-shard-size", "", "split into shards of at most SIZE (5GB, 500MB, or bytes) with an index, as transformers' save_pretrained")
		set.Var(&tied, "tied", "leave out NAME, which shares its segment with a name that is written, with no metadata entry, as save_pretrained drops a model's tied weights (repeat it, or NAME,NAME)")
	} else {
		set.String("pack-below", "0", "put each tensor of fewer than `SIZE` bytes (1MB, 500KB, or bytes; 0: none), tied to no other name, of a whole-byte dtype, into DIR/"+transfer.PackName+" instead of a segment of its own, as the Python client's save_state_dict(pack_below=N)")
	}
	if code, ok := parseFlags(set, args, synopsis, stdout, stderr); !ok {
		return code
	}
	maxShardSize, err1 := sizeFlag(set, "max-shard-size")
	packBelow, err2 := sizeFlag(set, "pack-below")
	if err := errors.Join(err1, err2); err != nil {
		fmt.Fprintf(stderr, "tensorfs %s: %v\n", op, err)
		return 2
	}
	if set.NArg() != 2 {
		fmt.Fprintf(stderr, "tensorfs %s: want %s\n", op, synopsis)
		return 2
	}
	from, to := set.Arg(0), set.Arg(1)
	ctx, stop := interruptible()
	defer stop()
	p := newProgress(stderr, op+"ing "+filepath.Base(from))
	sum, err := do(ctx, from, to, transfer.Options{
		Progress:     p.update,
		Warn:         func(msg string) { fmt.Fprintf(stderr, "tensorfs %s: %s\n", op, msg) },
		MaxShardSize: maxShardSize,
		Tied:         tied,
		PackBelow:    packBelow,
	})
	p.finish()
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs %s: %s\n", op, alloc.EscapeText(err.Error()))
		return 1
	}
	extra := ""
	if sum.Files > 1 {
		extra += fmt.Sprintf(", %d files", sum.Files)
	}
	if sum.Links > 0 {
		extra += fmt.Sprintf(", %d tied", sum.Links)
	}
	fmt.Fprintf(stdout, "%sed %d tensors (%s%s) from %s %s %s\n", op, sum.Tensors, byteCount(sum.Bytes), extra, from, into, to)
	return 0
}

// sizeFlag reads the SIZE given to the flag name of set as
// safetensors.ParseShardSize does: 0 when the command has no such flag or
// it keeps its default ("" or "0").
func sizeFlag(set *flag.FlagSet, name string) (int64, error) {
	f := set.Lookup(name)
	if f == nil || f.Value.String() == f.DefValue {
		return 0, nil
	}
	n, err := safetensors.ParseShardSize(f.Value.String())
	if err != nil {
		return 0, fmt.Errorf("--%s: %v", name, err)
	}
	return n, nil
}

// names is a flag that may be given many times, each a comma-separated
// list of names.
type names []string

func (n *names) String() string { return strings.Join(*n, ",") }

func (n *names) Set(v string) error {
	for _, name := range strings.Split(v, ",") {
		if name == "" {
			return errors.New("empty name")
		}
		*n = append(*n, name)
	}
	return nil
}

// interruptible returns a context that the first SIGINT or SIGTERM
// cancels: the command stops at its next check and removes what it wrote.
// The handlers go with it, so that a second signal ends the command at
// once wherever it is.
func interruptible() (context.Context, context.CancelFunc) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	context.AfterFunc(ctx, stop)
	return ctx, stop
}

// byteCount prints a size for a sentence: "101 bytes", "3.5M".
func byteCount(n int64) string {
	if n < 1024 {
		return strconv.FormatInt(n, 10) + " bytes"
	}
	return humanSize(n)
}

// progress draws "\rLABEL  412.0M/1.0G  40%  1.2G/s  ETA 1s" on a
// terminal, for copies over progressMin bytes, at most ten times a second.
type progress struct {
	w           io.Writer // nil: draw nothing
	label       string
	start, last time.Time
}

func newProgress(stderr io.Writer, label string) *progress {
	p := &progress{label: label, start: time.Now()}
	if isTerminal(stderr) {
		p.w = stderr
	}
	return p
}

// update draws the line for done of total bytes.
func (p *progress) update(done, total int64) {
	if p.w == nil || total <= progressMin {
		return
	}
	now := time.Now()
	if now.Sub(p.last) < 100*time.Millisecond && done < total {
		return
	}
	p.last = now
	elapsed := max(now.Sub(p.start).Seconds(), 1e-3)
	rate := float64(done) / elapsed
	eta := "-"
	if done > 0 {
		eta = time.Duration(float64(total-done) / rate * float64(time.Second)).Round(time.Second).String()
	}
	fmt.Fprintf(p.w, "\r%s  %s/%s  %3d%%  %s/s  ETA %s\x1b[K", p.label, humanSize(done), humanSize(total),
		done*100/total, humanSize(int64(rate)), eta)
}

// finish ends the progress line, if one was drawn.
func (p *progress) finish() {
	if p.w != nil && !p.last.IsZero() {
		fmt.Fprintln(p.w)
	}
}

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
