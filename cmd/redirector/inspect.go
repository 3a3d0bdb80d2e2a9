package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/redirector-mesh/redirector/pkg/admin"
	"github.com/redirector-mesh/redirector/pkg/loader"
	"github.com/redirector-mesh/redirector/pkg/maps"
)

// runInspect prints what the node's data path holds. `pods` and `maps` read
// the pinned maps directly, so they work while the agent is stopped;
// `workloads`, `services`, `certs` and `policies` ask the running agent's
// admin endpoint.
func runInspect(ctx context.Context, args []string) error {
	what := ""
	if len(args) > 0 {
		what = args[0]
	}
	s := newSettings("inspect " + what)
	s.synopsis = "redirector inspect pods|maps|workloads|services|certs|policies [flags]\n\n" +
		"pods and maps read the pinned maps (the agent may be stopped); the others ask the running agent's admin endpoint"
	root := s.add("bpf-root", "BPF_ROOT", loader.DefaultPinRoot, "where the agent pinned its maps")
	admin := s.add("admin-addr", "ADMIN_ADDR", "127.0.0.1:15000", "the agent's admin address")
	// -o has no env twin: a generic OUTPUT variable in the shell is not ours.
	out := s.add("o", "", "table", "output format: table, json or yaml")
	switch {
	case what == "":
		return fmt.Errorf("usage: redirector inspect pods|maps|workloads|services|certs|policies [-o table|json|yaml] (see redirector inspect -h)")
	case isHelp(what):
		s.help()
		return flag.ErrHelp
	}
	if err := s.parse(args[1:]); err != nil {
		return err
	}
	if !slices.Contains([]string{"table", "json", "yaml"}, *out) {
		return fmt.Errorf("%s: unknown output format %q (want table, json or yaml)", s.name(out), *out)
	}
	if err := s.checkPaths(root); err != nil {
		return err
	}
	switch what {
	case "pods":
		rows, err := inspectPods(*root)
		if err != nil {
			return err
		}
		return renderPods(os.Stdout, *out, rows)
	case "maps":
		rows, err := inspectMaps(*root)
		if err != nil {
			return err
		}
		return renderMaps(os.Stdout, *out, rows)
	case "certs", "workloads", "services", "policies":
		return inspectAdmin(ctx, *admin, what, *out)
	default:
		return fmt.Errorf("unknown inspect target %q (want pods, maps, workloads, services, certs or policies)", what)
	}
}

type podRow struct {
	ID             uint32           `json:"id"`
	UID            string           `json:"uid"`
	Namespace      string           `json:"namespace"`
	Name           string           `json:"name"`
	Addresses      []string         `json:"addresses"`
	CaptureInbound bool             `json:"captureInbound"`
	CaptureDNS     bool             `json:"captureDNS"`
	AttachMode     string           `json:"attachMode"`
	NetNS          string           `json:"netns"`
	Interface      string           `json:"interface"`
	Counters       maps.PodCounters `json:"counters"`
}

func inspectPods(root string) ([]podRow, error) {
	m, err := maps.OpenPinned(root)
	if err != nil {
		return nil, fmt.Errorf("%w (is an agent installed with --bpf-root %s?)", err, root)
	}
	defer m.Close()
	metas, err := m.ListMeta()
	if err != nil {
		return nil, err
	}
	var rows []podRow
	for id, meta := range metas {
		r := podRow{ID: id, UID: meta.UID, Namespace: meta.Namespace, Name: meta.Name, CaptureInbound: meta.Settings.CaptureInbound,
			CaptureDNS: meta.Settings.CaptureDNS, AttachMode: meta.AttachMode.String(), NetNS: meta.NetNS, Interface: meta.Interface}
		for _, a := range meta.Addrs {
			r.Addresses = append(r.Addresses, a.String())
			if c, ok, err := m.Counters(a); err == nil && ok {
				r.Counters.OutboundConns += c.OutboundConns
				r.Counters.InboundConns += c.InboundConns
				r.Counters.SteeredPackets += c.SteeredPackets
				r.Counters.DroppedPackets += c.DroppedPackets
				r.Counters.BypassedPackets += c.BypassedPackets
			}
		}
		rows = append(rows, r)
	}
	slices.SortFunc(rows, func(a, b podRow) int { return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name) })
	return rows, nil
}

type mapRow struct {
	Map   string `json:"map"`
	Key   string `json:"key"`
	Value string `json:"value"`
}

func inspectMaps(root string) ([]mapRow, error) {
	m, err := maps.OpenPinned(root)
	if err != nil {
		return nil, err
	}
	defer m.Close()
	var rows []mapRow
	pods, err := m.ListPods()
	if err != nil {
		return nil, err
	}
	for a, s := range pods {
		rows = append(rows, mapRow{maps.PodsName, a.String(), fmt.Sprintf("pod_id=%d outbound=%v inbound=%v dns=%v", s.PodID, s.CaptureOutbound, s.CaptureInbound, s.CaptureDNS)})
	}
	counters, err := m.AllCounters()
	if err != nil {
		return nil, err
	}
	for a, c := range counters {
		rows = append(rows, mapRow{maps.PodStatsName, a.String(), fmt.Sprintf("outbound_conns=%d inbound_conns=%d steered=%d dropped=%d bypassed=%d",
			c.OutboundConns, c.InboundConns, c.SteeredPackets, c.DroppedPackets, c.BypassedPackets)})
	}
	netnss, err := m.ListPodNetNS()
	if err != nil {
		return nil, err
	}
	for ino, e := range netnss {
		rows = append(rows, mapRow{maps.PodNetNSName, fmt.Sprintf("netns:[%d]", ino), fmt.Sprintf("pod_id=%d addr=%s", e.PodID, e.Addr)})
	}
	reasons, err := m.ReasonCounts()
	if err != nil {
		return nil, err
	}
	for r, n := range reasons {
		rows = append(rows, mapRow{maps.ReasonsName, maps.ReasonName(r), fmt.Sprint(n)})
	}
	slices.SortFunc(rows, func(a, b mapRow) int { return strings.Compare(a.Map+" "+a.Key, b.Map+" "+b.Key) })
	return rows, nil
}

func renderPods(w io.Writer, format string, rows []podRow) error {
	return render(w, format, rows, []string{"ID", "NAMESPACE", "NAME", "ADDRESSES", "INBOUND", "DNS", "MODE", "OUT-CONNS", "IN-CONNS", "DROPPED", "NETNS"}, func(r podRow) []string {
		return []string{fmt.Sprint(r.ID), r.Namespace, r.Name, strings.Join(r.Addresses, ","), fmt.Sprint(r.CaptureInbound), fmt.Sprint(r.CaptureDNS), r.AttachMode,
			fmt.Sprint(r.Counters.OutboundConns), fmt.Sprint(r.Counters.InboundConns), fmt.Sprint(r.Counters.DroppedPackets), r.NetNS}
	})
}

func renderMaps(w io.Writer, format string, rows []mapRow) error {
	return render(w, format, rows, []string{"MAP", "KEY", "VALUE"}, func(r mapRow) []string {
		return []string{r.Map, r.Key, r.Value}
	})
}

// renderCerts shows each identity's certificate: where it came from, its
// state and last CA error; -o json|yaml adds the chain in PEM.
func renderCerts(w io.Writer, format string, rows []certRow) error {
	return render(w, format, rows, []string{"IDENTITY", "STATE", "CA", "ISSUER", "SERIAL", "VALID TO", "REFRESH AT", "CHAIN", "LAST ERROR"}, func(r certRow) []string {
		at := func(t time.Time) string {
			if t.IsZero() {
				return "-"
			}
			return t.Format(time.RFC3339)
		}
		// The presented chain, leaf first: "leaf < CN=Intermediate CA".
		var chain []string
		for i, c := range r.Chain {
			if i == 0 || c.Subject == "" {
				chain = append(chain, "leaf")
				continue
			}
			chain = append(chain, c.Subject)
		}
		return []string{r.Identity, r.State, r.CA, orDash(r.Issuer), orDash(r.Serial), at(r.NotAfter), at(r.RefreshAt),
			orDash(strings.Join(chain, " < ")), orDash(r.LastError)}
	})
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// renderWorkloads prints istioctl ztunnel-config workloads' columns (no
// waypoint: the agent has none), then the workload and its identity.
func renderWorkloads(w io.Writer, format string, rows []admin.ZtunnelWorkload) error {
	return render(w, format, rows, []string{"NAMESPACE", "POD NAME", "ADDRESS", "NODE", "PROTOCOL", "WORKLOAD", "CANONICAL", "SERVICE ACCOUNT"}, func(r admin.ZtunnelWorkload) []string {
		return []string{r.Namespace, r.Name, strings.Join(r.WorkloadIPs, ","), r.Node, r.Protocol,
			r.WorkloadType + "/" + r.WorkloadName, r.CanonicalName + "@" + r.CanonicalRevision, r.ServiceAccount}
	})
}

// serviceRow is a service as the config dump shows it (ztunnel's shape,
// admin.ZtunnelService).
type serviceRow = admin.ZtunnelService

// renderServices prints istioctl ztunnel-config services' columns, with
// the ports and the endpoint addresses spelled out.
func renderServices(w io.Writer, format string, rows []serviceRow) error {
	return render(w, format, rows, []string{"NAMESPACE", "SERVICE NAME", "SERVICE VIP", "PORTS", "ENDPOINTS"}, func(r serviceRow) []string {
		var vips, ports, eps []string
		for _, v := range r.VIPs {
			_, ip, _ := strings.Cut(v, "/")
			vips = append(vips, ip)
		}
		for p, tp := range r.Ports {
			ports = append(ports, fmt.Sprintf("%s->%d", p, tp))
		}
		for _, e := range r.Endpoints {
			_, ip, _ := strings.Cut(e.Address, "/")
			eps = append(eps, ip)
		}
		slices.Sort(ports)
		slices.Sort(eps)
		return []string{r.Namespace, r.Name, strings.Join(vips, ","), strings.Join(ports, ","), strings.Join(eps, ",")}
	})
}

// render prints rows as a table, JSON or YAML.
func render[T any](w io.Writer, format string, rows []T, header []string, cells func(T) []string) error {
	switch format {
	case "json":
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(rows)
	case "yaml":
		b, err := yaml.Marshal(rows)
		if err != nil {
			return err
		}
		_, err = w.Write(b)
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(cells(r), "\t"))
	}
	return tw.Flush()
}

// inspectAdmin fetches one section of the running agent's config dump.
func inspectAdmin(ctx context.Context, addr, what, format string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/config_dump", nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("ask the agent at %s (is it running? certs and policies come from the live agent): %w", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("agent at %s answered %s", addr, resp.Status)
	}
	var dump map[string]json.RawMessage
	if err := json.NewDecoder(resp.Body).Decode(&dump); err != nil {
		return fmt.Errorf("decode config dump: %w", err)
	}
	section := dump[what]
	switch what {
	case "certs":
		var rows []certRow
		if err := json.Unmarshal(section, &rows); err != nil {
			return fmt.Errorf("decode certs: %w", err)
		}
		return renderCerts(os.Stdout, format, rows)
	case "workloads":
		var rows []admin.ZtunnelWorkload
		if err := json.Unmarshal(section, &rows); err != nil {
			return fmt.Errorf("decode workloads: %w", err)
		}
		return renderWorkloads(os.Stdout, format, rows)
	case "services":
		var rows []serviceRow
		if err := json.Unmarshal(section, &rows); err != nil {
			return fmt.Errorf("decode services: %w", err)
		}
		return renderServices(os.Stdout, format, rows)
	default:
		var v any
		if err := json.Unmarshal(section, &v); err != nil {
			return fmt.Errorf("decode %s: %w", what, err)
		}
		if format == "table" {
			format = "yaml" // policies are nested documents
		}
		return render(os.Stdout, format, []any{v}, nil, nil)
	}
}

// certRow is a certificate as the config dump shows it.
type certRow = admin.CertRow
