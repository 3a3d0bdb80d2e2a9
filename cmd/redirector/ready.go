package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"time"
)

// runReady is `redirector ready`: it asks this container's agent, over its
// readiness socket (READINESS_SOCKET), whether it is ready, and exits 0 only
// if it is. The chart's startup probe runs it. The TCP readiness port is the
// node's, shared with a predecessor agent during a surge upgrade, so a probe
// of it may be answered by the old agent; the socket is in the container's
// own /tmp, so only this agent answers it, and the successor passes for
// ready only once it is (its pods' listeners taken over, certificates in
// hand).
func runReady(ctx context.Context, args []string) error {
	s := newSettings("ready")
	sock := s.add("socket", "READINESS_SOCKET", "", "the agent's readiness socket")
	timeout := s.add("timeout", "", "3s", "how long to wait for the answer")
	if err := s.parse(args); err != nil {
		return err
	}
	if err := s.require(sock); err != nil {
		return err
	}
	d, err := time.ParseDuration(*timeout)
	if err != nil || d <= 0 {
		return fmt.Errorf("%s: %q is not a positive duration", s.name(timeout), *timeout)
	}
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	ready, body, err := askReady(ctx, *sock)
	if err != nil {
		return fmt.Errorf("readiness socket %s: %w", *sock, err)
	}
	if !ready {
		return fmt.Errorf("%s", strings.TrimSpace(body))
	}
	fmt.Print(body)
	return nil
}

// askReady sends GET /healthz/ready over the unix socket at path and
// returns whether the agent answered 200, with the answer's first line.
func askReady(ctx context.Context, path string) (bool, string, error) {
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return dialUnixRetry(ctx, path)
	}}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent/healthz/ready", nil)
	if err != nil {
		return false, "", err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return false, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if err != nil {
		return false, "", err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	return resp.StatusCode == http.StatusOK, line + "\n", nil
}

// backlogRetry is how soon a connect refused for a full backlog is tried
// again.
const backlogRetry = 10 * time.Millisecond

// dialUnixRetry connects to the unix socket at path, trying again until ctx
// ends while its listen backlog is full: a unix socket refuses a connect
// then at once (EAGAIN) instead of queueing it, and clients opening
// connections faster than the agent accepts them fill it for moments,
// which must not fail the startup probe.
func dialUnixRetry(ctx context.Context, path string) (net.Conn, error) {
	for {
		c, err := (&net.Dialer{}).DialContext(ctx, "unix", path)
		if err == nil || !errors.Is(err, syscall.EAGAIN) {
			return c, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(backlogRetry):
		}
	}
}
