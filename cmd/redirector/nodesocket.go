package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/redirector-mesh/redirector/pkg/admin"
)

// pathSocket is a unix socket at a path every agent of the node shares,
// installed by renaming it over the path (unixsock.Install): cni.Server,
// tunnel.HandoverServer.
type pathSocket interface {
	Path() string
	// Listen installs the socket at the path; Serve, next, serves it
	// until ctx ends.
	Listen() error
	Serve(ctx context.Context) error
	// Installed reports whether the path still names the served socket.
	Installed() bool
}

// nodeSocket serves a pathSocket for the agent that holds the node. The
// path names the socket of whoever renamed over it last, so the rule is
// in one place for every such socket: the socket is installed only while
// held says this agent holds the node, and while it is served, finding
// (every ownPathCheck) that the path no longer names it while the agent
// holds the node installs it again. An agent that yielded installs
// nothing and never takes the path back from the holder. The path is
// checked before held: an agent claims the node before it installs, so one
// whose socket replaced this one's already holds the node.
type nodeSocket struct {
	sock pathSocket
	// what names the socket in logs ("CNI event socket"), setting in
	// readiness ("--cni-socket (CNI_SOCKET)"); unserved says, after the
	// error log's "not served", what that costs.
	what, setting, unserved string
	// retry is the wait before serving again after an error.
	retry time.Duration
	// after are closed before the first install (nil ones are skipped).
	after []<-chan struct{}
	// A value on reinstall (nil: none) serves the socket anew, held or
	// not: the agent took the node back (see OnReclaim).
	reinstall <-chan struct{}
	held      func() bool
}

// ownPathCheck is how often nodeSocket checks that the path is still the
// served socket (one lstat), and, while another agent holds the node,
// whether this one holds it again (one map lookup).
const ownPathCheck = time.Second

// serve serves the socket until ctx ends, and returns a readiness check
// that fails, with the error, while it is not served.
func (n nodeSocket) serve(ctx context.Context, log *slog.Logger) admin.Check {
	var mu sync.Mutex
	failed := errors.New("not served yet")
	set := func(err error) {
		mu.Lock()
		failed = err
		mu.Unlock()
	}
	path := n.sock.Path()
	go func() {
		for _, c := range n.after {
			if c == nil {
				continue
			}
			select {
			case <-ctx.Done():
				return
			case <-c:
			}
		}
		force, waiting := false, false
		for {
			if !force && !n.held() {
				if !waiting {
					log.Info(n.what+" not installed: another agent holds the node", "socket", path)
					waiting = true
				}
				select {
				case <-ctx.Done():
					return
				case <-n.reinstall:
					force = true
				case <-time.After(ownPathCheck):
				}
				continue
			}
			force, waiting = false, false
			err := n.sock.Listen()
			if err == nil {
				set(nil)
				sctx, cancel := context.WithCancel(ctx)
				served := make(chan struct{})
				// Whether the watch below ended the serving for a
				// reinstall: sent once, as it returns.
				forced := make(chan bool, 1)
				go func() {
					tick := time.NewTicker(ownPathCheck)
					defer tick.Stop()
					for {
						select {
						case <-n.reinstall:
							forced <- true
							cancel()
							return
						case <-served:
							forced <- false
							return
						case <-tick.C:
							if !n.sock.Installed() && n.held() {
								log.Warn(n.what+" at the path is not this agent's (another agent installed its own over it, or it was removed) while this agent holds the node: installing it again", "socket", path)
								forced <- false
								cancel()
								return
							}
						}
					}
				}()
				err = n.sock.Serve(sctx)
				close(served)
				force = <-forced
				again := sctx.Err() != nil && ctx.Err() == nil
				cancel()
				if again {
					log.Info(n.what+" installed again", "socket", path)
					continue
				}
			}
			if ctx.Err() != nil {
				return
			}
			log.Error(n.what+" not served"+n.unserved+"; retrying", "socket", path, "error", err, "retry_in", n.retry)
			set(fmt.Errorf("%s: %w", n.setting, err))
			select {
			case <-ctx.Done():
				return
			case <-time.After(n.retry):
			}
		}
	}()
	return func() (bool, string) {
		mu.Lock()
		defer mu.Unlock()
		if failed != nil {
			return false, n.what + ": " + failed.Error()
		}
		return true, ""
	}
}
