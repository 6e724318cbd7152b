// Command tensorfs-testbed runs the parts of a cluster test bed
// (scripts/cluster.sh) that are not the tensorfs daemon: etcd (the etcd
// binary on PATH, until SIGTERM), and two clients the tests use to play a
// hostile member or outsider.
//
//	tensorfs-testbed etcd -dir DIR -listen HOST:PORT -ca F -cert F -key F
//	tensorfs-testbed put -etcd URL -ca F -cert F -key F KEY VALUE...
//	tensorfs-testbed keys -etcd URL -ca F -cert F -key F PREFIX
//	tensorfs-testbed fetch -peer NAME@HOST:PORT -ca F -cert F -key F CONTENT INDEX
//
// put writes raw keys into etcd, as any holder of a certificate of the
// cluster may (what a forged manifest looks like to the daemons). fetch
// asks a node's piece server for one piece and prints how many bytes came,
// or fails with the peer's refusal. keys prints the keys under PREFIX, one
// a line, each after the bytes it and its value take and before its
// lease (hex, 0 for none).
package main

import (
	"context"
	"flag"
	"fmt"
	"math"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"tensorfs/cluster/transport"
	"tensorfs/internal/etcdtest"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: tensorfs-testbed etcd|put|fetch ...")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "etcd":
		err = runEtcd(os.Args[2:])
	case "put":
		err = runPut(os.Args[2:])
	case "keys":
		err = runKeys(os.Args[2:])
	case "fetch":
		err = runFetch(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q: want etcd, put, keys or fetch", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "tensorfs-testbed:", err)
		os.Exit(1)
	}
}

// runEtcd runs a single-member etcd until SIGTERM.
func runEtcd(args []string) error {
	fl := flag.NewFlagSet("etcd", flag.ExitOnError)
	dir := fl.String("dir", "", "data directory")
	listen := fl.String("listen", "", "client address, host:port")
	ca := fl.String("ca", "", "cluster CA (PEM)")
	cert := fl.String("cert", "", "etcd's certificate (PEM)")
	key := fl.String("key", "", "etcd's key (PEM)")
	fl.Parse(args)
	host, _, err := net.SplitHostPort(*listen)
	if err != nil {
		return err
	}
	s, err := etcdtest.Start(*dir, *listen, net.JoinHostPort(host, "2380"), etcdtest.TLS{CA: *ca, Cert: *cert, Key: *key}, os.Stderr)
	if err != nil {
		return err
	}
	fmt.Fprintln(os.Stderr, "etcd ready at", s.ClientURL)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case <-sig:
	case err = <-s.Err():
	}
	s.Stop()
	return err
}

// credentials reads the -ca, -cert and -key flags of fl.
func credentials(fl *flag.FlagSet) func() (*transport.Credentials, error) {
	ca := fl.String("ca", "", "cluster CA (PEM)")
	cert := fl.String("cert", "", "certificate (PEM)")
	key := fl.String("key", "", "key (PEM)")
	return func() (*transport.Credentials, error) { return transport.LoadCredentials(*ca, *cert, *key) }
}

// etcdClient parses the flags of a command that reaches etcd (-etcd and
// credentials) and connects.
func etcdClient(name string, args []string) (*clientv3.Client, *flag.FlagSet, error) {
	fl := flag.NewFlagSet(name, flag.ExitOnError)
	endpoint := fl.String("etcd", "", "etcd client URL")
	creds := credentials(fl)
	fl.Parse(args)
	c, err := creds()
	if err != nil {
		return nil, nil, err
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{*endpoint}, DialTimeout: 3 * time.Second,
		TLS: c.ClientConfig(""), Logger: zap.NewNop()})
	return cli, fl, err
}

// runKeys prints the keys under a prefix, each after its and its value's
// bytes.
func runKeys(args []string) error {
	cli, fl, err := etcdClient("keys", args)
	if err != nil {
		return err
	}
	defer cli.Close()
	if fl.NArg() != 1 {
		return fmt.Errorf("keys: want a PREFIX")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, fl.Arg(0), clientv3.WithPrefix())
	if err != nil {
		return err
	}
	for _, kv := range resp.Kvs {
		fmt.Printf("%d %s %x\n", len(kv.Key)+len(kv.Value), kv.Key, kv.Lease)
	}
	return nil
}

// runPut writes KEY VALUE pairs into etcd in one transaction.
func runPut(args []string) error {
	cli, fl, err := etcdClient("put", args)
	if err != nil {
		return err
	}
	defer cli.Close()
	if fl.NArg() == 0 || fl.NArg()%2 != 0 {
		return fmt.Errorf("put: want KEY VALUE pairs")
	}
	var ops []clientv3.Op
	for i := 0; i < fl.NArg(); i += 2 {
		ops = append(ops, clientv3.OpPut(fl.Arg(i), fl.Arg(i+1)))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = cli.Txn(ctx).Then(ops...).Commit()
	return err
}

// maxPiece lets fetch take a piece of any size.
const maxPiece = math.MaxInt64

// discard is a destination that keeps nothing.
type discard struct{}

func (discard) WriteAt(b []byte, off int64) (int, error) { return len(b), nil }

// runFetch fetches one piece from a peer and prints its size.
func runFetch(args []string) error {
	fl := flag.NewFlagSet("fetch", flag.ExitOnError)
	peer := fl.String("peer", "", "NAME@HOST:PORT of the piece server")
	creds := credentials(fl)
	fl.Parse(args)
	name, addr, ok := strings.Cut(*peer, "@")
	if !ok || fl.NArg() != 2 {
		return fmt.Errorf("fetch: want -peer NAME@HOST:PORT CONTENT INDEX")
	}
	index, err := strconv.Atoi(fl.Arg(1))
	if err != nil {
		return err
	}
	c, err := creds()
	if err != nil {
		return err
	}
	tr, err := transport.NewStream(transport.Config{Credentials: c})
	if err != nil {
		return err
	}
	defer tr.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := tr.Fetch(ctx, transport.Peer{Name: name, Addr: addr}, transport.Piece{Content: fl.Arg(0), Index: index}, transport.Dest{File: discard{}, Len: maxPiece})
	if err != nil {
		return err
	}
	fmt.Println(n)
	return nil
}
