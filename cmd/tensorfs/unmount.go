package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"

	"tensorfs/lifecycle"
)

func runUnmount(args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs unmount", flag.ContinueOnError)
	purge := set.Bool("purge", false, "also release the backing memory (SHARED segments on disk are kept)")
	if code, ok := parseFlags(set, args, "[--purge] MOUNTPOINT", stdout, stderr); !ok {
		return code
	}
	if set.NArg() != 1 {
		fmt.Fprintln(stderr, "tensorfs unmount: want exactly one MOUNTPOINT")
		return 2
	}
	mp, err := filepath.Abs(set.Arg(0))
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs unmount: %v\n", err)
		return 1
	}
	res, err := lifecycle.Unmount(mp, *purge)
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs unmount: %v\n", err)
		return 1
	}
	if res.Busy {
		fmt.Fprintln(stdout, busyMessage(mp, res.Pid, res.Held, *purge))
	}
	return 0
}

func runRestart(args []string, stdout, stderr io.Writer) int {
	set := flag.NewFlagSet("tensorfs restart", flag.ContinueOnError)
	binary := set.String("binary", "", "the new daemon's binary (default: this one)")
	if code, ok := parseFlags(set, args, "[--binary PATH] MOUNTPOINT", stdout, stderr); !ok {
		return code
	}
	if set.NArg() != 1 {
		fmt.Fprintln(stderr, "tensorfs restart: want exactly one MOUNTPOINT")
		return 2
	}
	mp, err := filepath.Abs(set.Arg(0))
	if err == nil && *binary != "" {
		*binary, err = filepath.Abs(*binary)
	}
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs restart: %v\n", err)
		return 1
	}
	if *binary == "" {
		*binary, err = os.Executable()
	}
	if err == nil {
		// The keeper follows no symbolic link (lifecycle.openBinary).
		*binary, err = filepath.EvalSymlinks(*binary)
	}
	var ready string
	if err == nil {
		ready, err = lifecycle.Restart(mp, *binary)
	}
	if err != nil {
		fmt.Fprintf(stderr, "tensorfs restart: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "tensorfs: restarted %s (%s)\n", mp, ready)
	return 0
}

// busyMessage says what unmount left: a detached mount whose daemon
// serves its users until the last one exits.
func busyMessage(mp string, pid, held int, purge bool) string {
	users := "its files are still in use"
	switch {
	case held == 1:
		users = "1 process still holds files"
	case held > 1:
		users = strconv.Itoa(held) + " processes still hold files"
	}
	then := "serves them until the last one exits"
	if purge {
		then = "purges the backing when the last one exits"
	}
	return fmt.Sprintf("tensorfs unmount: %s detached; %s; the daemon (pid %d) %s", mp, users, pid, then)
}
