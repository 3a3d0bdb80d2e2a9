// Command cnidriver runs one CNI operation on a network configuration list
// through libcni, the way a container runtime does, for the redirector-cni
// chain tests (built by hack/cni-plugins.sh). The tests start it under nsenter
// in a throwaway "node" network namespace: plugins such as bridge and ptp
// create links in the namespace of the process that runs them, and a Go
// program's children only have a well-defined namespace if the whole process
// was started in it.
//
//	cnidriver -op add|check|del -conflist FILE -path DIR[:DIR...] -cachedir DIR \
//	    -netns PATH -id CONTAINER -ifname eth0 -args 'K8S_POD_NAME=a;K8S_POD_NAMESPACE=b'
//
// ADD prints the chain's result as CNI 1.1.0 JSON on stdout. A failure prints
// libcni's error, which quotes the failing plugin's message, on stderr and
// exits 1.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	types100 "github.com/containernetworking/cni/pkg/types/100"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "cnidriver:", err)
		os.Exit(1)
	}
}

func run() error {
	op := flag.String("op", "", "add, check or del")
	conflist := flag.String("conflist", "", "network configuration list file")
	path := flag.String("path", "", "CNI_PATH: plugin directories, colon-separated")
	cacheDir := flag.String("cachedir", "", "libcni result cache (never the machine's /var/lib/cni)")
	netnsPath := flag.String("netns", "", "the pod's network namespace file")
	id := flag.String("id", "", "container id")
	ifName := flag.String("ifname", "eth0", "interface name in the pod")
	cniArgs := flag.String("args", "", "CNI_ARGS, K=V pairs separated by ';'")
	timeout := flag.Duration("timeout", time.Minute, "give up after this long")
	flag.Parse()
	if *conflist == "" || *path == "" || *cacheDir == "" || *id == "" {
		return errors.New("-conflist, -path, -cachedir and -id are required")
	}

	data, err := os.ReadFile(*conflist)
	if err != nil {
		return err
	}
	list, err := libcni.NetworkConfFromBytes(data)
	if err != nil {
		return fmt.Errorf("parse %s: %w", *conflist, err)
	}
	cfg := libcni.NewCNIConfigWithCacheDir(filepath.SplitList(*path), *cacheDir, nil)
	rt := &libcni.RuntimeConf{ContainerID: *id, NetNS: *netnsPath, IfName: *ifName}
	for pair := range strings.SplitSeq(*cniArgs, ";") {
		if k, v, ok := strings.Cut(pair, "="); ok {
			rt.Args = append(rt.Args, [2]string{k, v})
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	switch *op {
	case "add":
		res, err := cfg.AddNetworkList(ctx, list, rt)
		if err != nil {
			return fmt.Errorf("add %s: %w", list.Name, err)
		}
		out, err := types100.NewResultFromResult(res)
		if err != nil {
			return fmt.Errorf("convert result: %w", err)
		}
		out.CNIVersion = "1.1.0"
		return json.NewEncoder(os.Stdout).Encode(out)
	case "check":
		if err := cfg.CheckNetworkList(ctx, list, rt); err != nil {
			return fmt.Errorf("check %s: %w", list.Name, err)
		}
		return nil
	case "del":
		if err := cfg.DelNetworkList(ctx, list, rt); err != nil {
			return fmt.Errorf("del %s: %w", list.Name, err)
		}
		return nil
	default:
		return fmt.Errorf("unknown -op %q", *op)
	}
}
