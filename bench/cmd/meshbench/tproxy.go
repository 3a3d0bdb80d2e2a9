package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/redirector-mesh/redirector/pkg/loader"
	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// setupTPROXY captures pod p's outbound TCP with iptables into the relay,
// the way Istio's sidecar TPROXY mode and local transparent proxies do:
//
//   - mangle OUTPUT marks the app's TCP (not the relay's marked sockets, not
//     loopback) with the re-inject mark; a fwmark rule sends marked packets
//     to a table whose only route is `local 0.0.0.0/0 dev lo`, so they loop
//     back into the pod;
//   - mangle PREROUTING on lo hands a new connection to the relay's
//     transparent listener (TPROXY), and sends packets of connections the
//     relay already owns (`-m socket --transparent`) straight to their socket.
//
// Everything lives in the pod's network namespace (nsenter --net), so it
// goes away with the namespace; nothing touches the machine's own tables.
func setupTPROXY(ctx context.Context, r *netnstest.Runner, p *netnstest.Pod) (*child, error) {
	s := loader.DefaultSettings()
	relay, err := startChild(r, p.Path(), "iptables relay", selfPath(), "relay",
		"-network", "tcp4", "-listen", fmt.Sprintf("0.0.0.0:%d", s.OutboundPort), "-mark", fmt.Sprint(s.TunnelMark))
	if err != nil {
		return nil, err
	}
	if _, err := relay.waitLine(ctx, "ready", 10*time.Second); err != nil {
		return nil, err
	}
	mark := fmt.Sprintf("%#x/%#x", s.ReinjectMark, s.MarkMask)
	tunnel := fmt.Sprintf("%#x/%#x", s.TunnelMark, s.MarkMask)
	table := fmt.Sprint(s.RouteTable)
	for _, cmd := range []string{
		"ip rule add fwmark " + mark + " lookup " + table,
		"ip route add local 0.0.0.0/0 dev lo table " + table,
		"iptables -w -t mangle -N RD_DIVERT",
		"iptables -w -t mangle -A RD_DIVERT -j MARK --set-xmark " + mark,
		"iptables -w -t mangle -A RD_DIVERT -j ACCEPT",
		"iptables -w -t mangle -A PREROUTING -p tcp -m socket --transparent -j RD_DIVERT",
		fmt.Sprintf("iptables -w -t mangle -A PREROUTING -p tcp -i lo -m mark --mark %s -j TPROXY --on-port %d --tproxy-mark %s",
			mark, s.OutboundPort, mark),
		"iptables -w -t mangle -A OUTPUT -p tcp -m mark --mark " + tunnel + " -j RETURN",
		"iptables -w -t mangle -A OUTPUT -p tcp -d 127.0.0.0/8 -j RETURN",
		"iptables -w -t mangle -A OUTPUT -p tcp -o lo -j RETURN",
		"iptables -w -t mangle -A OUTPUT -p tcp -j MARK --set-xmark " + mark,
	} {
		f := strings.Fields(cmd)
		if _, err := output(ctx, p.Path(), 10*time.Second, f[0], f[1:]...); err != nil {
			return nil, fmt.Errorf("in pod %s: %w", p.Name, err)
		}
	}
	return relay, nil
}
