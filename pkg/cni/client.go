package cni

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"syscall"
	"time"

	"github.com/redirector-mesh/redirector/pkg/unixsock"
)

// DefaultNotifyTimeout bounds Notify when ctx has no deadline. Enrolling a pod
// takes well under a second; the bound is for an agent that hangs, so that
// the runtime gets an error and retries instead of waiting forever.
const DefaultNotifyTimeout = 30 * time.Second

// Notify sends ev to the agent at socketPath (DefaultSocketPath if empty) and
// waits for its answer. An answer carrying Response.Error is still returned
// with a nil error: the agent spoke, and the caller decides what the answer
// means. Errors are about the exchange itself; those that happened before
// the agent received anything wrap ErrAgentUnreachable.
func Notify(ctx context.Context, socketPath string, ev PodEvent) (Response, error) {
	if socketPath == "" {
		socketPath = DefaultSocketPath
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultNotifyTimeout)
		defer cancel()
	}
	body, err := json.Marshal(ev)
	if err != nil {
		return Response{}, fmt.Errorf("encode CNI event: %w", err)
	}
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			c, err := d.DialContext(ctx, "unix", socketPath)
			if err != nil {
				if noListener(err) {
					return nil, fmt.Errorf("%w: %w", ErrAgentUnreachable, err)
				}
				return nil, fmt.Errorf("agent socket %s: %w", socketPath, err)
			}
			if err := checkAgentPeer(c, socketPath); err != nil {
				c.Close()
				return nil, err
			}
			return c, nil
		},
		DisableKeepAlives: true,
	}}
	// The host part is never resolved: every connection goes to the socket.
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://redirector-agent"+EventPath, bytes.NewReader(body))
	if err != nil {
		return Response{}, fmt.Errorf("build CNI event request: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	res, err := client.Do(req)
	if err != nil {
		// The url.Error around it would only add the made-up URL.
		if uerr := (*url.Error)(nil); errors.As(err, &uerr) {
			err = uerr.Err
		}
		return Response{}, fmt.Errorf("send %s event for pod %s to the agent at %s: %w", ev.Command, ev, socketPath, err)
	}
	defer res.Body.Close()
	data, err := io.ReadAll(io.LimitReader(res.Body, maxEventBytes))
	if err != nil {
		return Response{}, fmt.Errorf("read the agent's answer to %s for pod %s: %w", ev.Command, ev, err)
	}
	var resp Response
	if err := json.Unmarshal(data, &resp); err != nil {
		return Response{}, fmt.Errorf("decode the agent's answer to %s for pod %s (HTTP %d): %w: %q", ev.Command, ev, res.StatusCode, err, truncate(data, 200))
	}
	if res.StatusCode != http.StatusOK && resp.Error == "" {
		resp.Error = fmt.Sprintf("agent answered HTTP %d without a reason", res.StatusCode)
	}
	return resp, nil
}

// noListener says whether a dial error proves that no agent listens at the
// socket: no file there (ENOENT, ENOTDIR), or a file nobody listens on
// (ECONNREFUSED, left by an agent that died). Only then may the plugin fall
// back to the selection hint. Any other error means an agent may be there:
// EAGAIN is a full accept queue (an agent that is busy or hung, whose
// connections wait unaccepted; each plugin that gave up leaves its own
// queued), and taking it for "no agent" let pods the hint does not know
// start unmeshed while the agent ran.
func noListener(err error) bool {
	return errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ENOTDIR) || errors.Is(err, syscall.ECONNREFUSED)
}

func truncate(b []byte, n int) string {
	if len(b) > n {
		return string(b[:n]) + "..."
	}
	return string(b)
}

// checkAgentPeer refuses a socket served by anyone but root or the plugin's
// own user (SO_PEERCRED of the listener). The agent runs as root; whoever
// else put a socket at the path (a directory with looser modes) would
// answer "enrolled" or "not selected" and have pods start unmeshed. The
// error is not ErrAgentUnreachable: the plugin must not fall back to the
// hint either, since the socket is not the agent's.
func checkAgentPeer(c net.Conn, socketPath string) error {
	cred, err := unixsock.PeerCred(c)
	if err != nil {
		return fmt.Errorf("agent socket %s: %w", socketPath, err)
	}
	if !unixsock.Trusted(cred) {
		return fmt.Errorf("agent socket %s is served by uid %d, neither root nor this plugin's user: not the agent's, refusing its answer", socketPath, cred.Uid)
	}
	return nil
}
