package xds

import (
	"cmp"
	"errors"
	"net/netip"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// Node is how the agent introduces itself to istiod. istiod serves
// workload xDS (Address, Authorization) only to proxies of type ztunnel,
// so the agent presents itself as one, exactly as ztunnel's xDS client
// does: node id ztunnel~<ip>~<pod>.<namespace>~<namespace>.svc.<domain>
// and the metadata NAME, NAMESPACE, INSTANCE_IPS, NODE_NAME,
// ISTIO_VERSION and CLUSTER_ID. istiod checks that the token's namespace
// is NAMESPACE (the proxy's config namespace).
type Node struct {
	// IP is the agent's pod address.
	IP netip.Addr
	// PodName and PodNamespace are the agent's own pod.
	PodName, PodNamespace string
	// NodeName is the Kubernetes node the agent serves.
	NodeName string
	// ClusterID is istiod's name for this cluster ("Kubernetes" by
	// default).
	ClusterID string
	// IstioVersion is reported as ISTIO_VERSION; empty sends the version
	// istiod is compatible with.
	IstioVersion string
	// DNSDomain is the cluster domain; empty means cluster.local.
	DNSDomain string
}

// DefaultIstioVersion is the ISTIO_VERSION sent when Node names none: the
// minor version whose workload API this client speaks.
const DefaultIstioVersion = "1.31.0"

func (n Node) validate() error {
	switch {
	case !n.IP.IsValid():
		return errors.New("xds node: no pod IP")
	case n.PodName == "" || n.PodNamespace == "":
		return errors.New("xds node: pod name and namespace are required")
	case n.NodeName == "":
		return errors.New("xds node: node name is required")
	}
	return nil
}

// ID is the node id istiod parses (type~ip~id~domain).
func (n Node) ID() string {
	return "ztunnel~" + n.IP.String() + "~" + n.PodName + "." + n.PodNamespace + "~" + n.PodNamespace + ".svc." + cmp.Or(n.DNSDomain, "cluster.local")
}

func (n Node) proto() *corev3.Node {
	meta := map[string]*structpb.Value{
		"NAME":          structpb.NewStringValue(n.PodName),
		"NAMESPACE":     structpb.NewStringValue(n.PodNamespace),
		"INSTANCE_IPS":  structpb.NewStringValue(n.IP.String()),
		"NODE_NAME":     structpb.NewStringValue(n.NodeName),
		"ISTIO_VERSION": structpb.NewStringValue(cmp.Or(n.IstioVersion, DefaultIstioVersion)),
	}
	if n.ClusterID != "" {
		meta["CLUSTER_ID"] = structpb.NewStringValue(n.ClusterID)
	}
	return &corev3.Node{Id: n.ID(), Metadata: &structpb.Struct{Fields: meta}}
}
