// Package xds receives the mesh from istiod the way ztunnel does: one
// delta ADS stream (envoy.service.discovery.v3.AggregatedDiscoveryService/
// DeltaAggregatedResources) subscribed to istio.workload.Address
// (workloads and services) and istio.security.Authorization (policies
// compiled by istiod, PeerAuthentication included), translated into the
// project's own types (model.go) as they arrive. Nothing past this package
// sees the wire types.
//
// Protocol: every response is answered, with an ACK when every resource in
// it was applied and otherwise with a NACK whose error_detail names each
// rejected resource and why. The resources of a response that could be
// translated are applied even when others are rejected (as ztunnel does);
// a rejected workload or service keeps its previous version, and a
// rejected policy is held in a fail-closed form instead (a DENY that
// denies all it selects, an ALLOW that admits nothing), since leaving a
// policy out can only admit more. After a reconnect the
// client sends the versions it holds (initial_resource_versions), so
// istiod sends only what changed and what was removed meanwhile; while
// istiod is away the last state stays in force. Reconnects back off with
// jitter.
//
// Bounds: a response is at most MaxMessageBytes and 8 fields per resource
// of MaxResources, nested at most MaxDepth deep (counted before gRPC
// decodes it), a resource holds at most
// MaxResourceMessages nested messages (checked before decoding), and a
// type holds at most MaxResources resources charged at most MaxTypeBytes
// in all (encoded size plus a per-message overhead, see charge, plus its
// name and version, themselves bounded); what would go beyond is rejected
// (NACKed) and counted. A resource must bear istiod's name for its content
// (resourceName).
package xds

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"

	"github.com/redirector-mesh/redirector/pkg/policy"
)

// The type URLs ztunnel subscribes to.
const (
	TypeAddress       = "type.googleapis.com/istio.workload.Address"
	TypeAuthorization = "type.googleapis.com/istio.security.Authorization"
)

// Defaults of Config's bounds and backoff.
const (
	DefaultMaxResources = 200_000
	// DefaultMaxMessageBytes admits istiod's push of DefaultMaxResources
	// (it sends all it has in one response): a Deployment's pod is some
	// 460 bytes there, 200k of them 88 MiB; this leaves room for longer
	// names, as ztunnel's 200 MiB does. At 64 MiB a mesh of 145k pods
	// never synced.
	DefaultMaxMessageBytes = 200 << 20
	DefaultMaxTypeBytes    = 512 << 20
	// DefaultMaxResourceMessages bounds the messages nested in one
	// resource: a policy of 100k conditions, far beyond any real one.
	DefaultMaxResourceMessages = 100_000
	DefaultMinBackoff          = 500 * time.Millisecond
	DefaultMaxBackoff          = 30 * time.Second
	// DefaultFirstSyncGrace is how long after the first response of one
	// type the client waits for the others before it warns that they are
	// missing (istiod answers every subscription, even with nothing).
	DefaultFirstSyncGrace = 3 * time.Second
	// DefaultSilentWarn is how long a stream istiod accepted may go
	// without any response before the client warns: istiod answers every
	// subscription within seconds, even with nothing, so one that never
	// does (a proxy in between holding the stream, an istiod stuck before
	// its first push) is named rather than waited on in silence.
	DefaultSilentWarn  = 30 * time.Second
	DefaultSnapshotGap = 50 * time.Millisecond
)

// Bounds on what a resource or a NACK carries besides its value. istiod
// names a resource by a workload's uid (cluster, kind, namespace, name and
// maybe an address or host), namespace/hostname or namespace/name: a few
// hundred bytes at most; its versions are hashes or timestamps. Both are
// held and sent back on a reconnect, so they are bounded and charged.
const (
	MaxNameBytes    = 1024
	MaxVersionBytes = 256
	// maxNackErrors and maxErrorBytes (a quarter of it for the name)
	// bound a NACK's error_detail and its log line: one response may
	// reject thousands of resources.
	maxNackErrors = 20
	maxErrorBytes = 512
	// maxListedUnresolved bounds the names Snapshot.Unresolved lists (the
	// rest as a count): the list is quoted in every refusal.
	maxListedUnresolved = 20
	// maxUnresolved bounds the names of unresolved policies kept (1 MiB at
	// most); past it they are kept by a 64-bit hash only (random seed, so
	// istiod cannot aim two names at one hash). Any one of them refuses
	// every inbound connection already, so nothing is lost by not
	// listing them.
	maxUnresolved = 1024
	// maxOverflow bounds the hashes of unresolved names past maxUnresolved
	// (a few hundred KiB); past it they are only counted.
	maxOverflow = 16 * maxUnresolved
)

// ClusterIDHeader is the request header naming the cluster whose API
// server issued the token (as for istiod's CA).
const ClusterIDHeader = "ClusterID"

// Config configures a Client.
type Config struct {
	// Conn is the connection to istiod's xDS port (15012), with TLS that
	// verifies istiod (see Dial).
	Conn grpc.ClientConnInterface
	Node Node
	// Network is the network this node is on, as istiod names it (its
	// topology.istio.io/network; "" is the default network). Workloads
	// and service addresses istiod puts on other networks are not
	// reachable directly and are left out (see Snapshot.Network).
	Network string
	// Token returns the bearer token for a new stream (the agent's
	// istio-ca token, re-read since the kubelet rotates it); nil sends
	// none.
	Token func() (string, error)
	// MaxResources bounds each type's resources; 0 means
	// DefaultMaxResources.
	MaxResources int
	// MaxMessageBytes bounds one response; 0 means
	// DefaultMaxMessageBytes.
	MaxMessageBytes int
	// MaxTypeBytes bounds the size of all resources held of one type,
	// each charged its encoded size plus an overhead per resource and per
	// nested message (see resourceOverhead); 0 means DefaultMaxTypeBytes.
	MaxTypeBytes int
	// MaxResourceMessages bounds the messages nested in one resource,
	// checked before it is decoded; 0 means DefaultMaxResourceMessages.
	MaxResourceMessages int
	// MinBackoff and MaxBackoff bound the reconnect delay; 0 means the
	// defaults.
	MinBackoff, MaxBackoff time.Duration
	// FirstSyncGrace: 0 means DefaultFirstSyncGrace.
	FirstSyncGrace time.Duration
	// SilentWarn: 0 means DefaultSilentWarn.
	SilentWarn time.Duration
	// SnapshotGap is the least time between two snapshots (see
	// publisher); 0 means DefaultSnapshotGap.
	SnapshotGap time.Duration
	Metrics     *Metrics
	Logger      *slog.Logger
}

// Client keeps the state istiod sent. Only Run's goroutine touches it.
type Client struct {
	cfg   Config
	log   *slog.Logger
	types []*resourceType
	// synced is true once every type answered at least once. Never
	// before: a snapshot without the policies would admit what they
	// deny (STRICT arrives as a DENY of plaintext).
	synced bool
	pub    *publisher
}

// resourceType is the state of one subscribed type.
type resourceType struct {
	url   string
	short string
	// decode translates one resource's bytes.
	decode func([]byte) (any, error)
	// desc is the resource's message type, for charge.
	desc protoreflect.MessageDescriptor
	held map[string]entry
	// bytes is what held is charged (see charge).
	bytes int
	// received is true once a response of this type arrived on any stream.
	received bool
	// unresolved (policies only; nil for other types) names the resources
	// rejected without anything held in their place, so their reach is
	// unknown and the snapshot fails closed while there are any; more
	// counts those beyond the bound. istiod resends what the client does
	// not hold on a new stream, so the first response there (fresh)
	// rebuilds the list.
	unresolved map[string]bool
	// overflow holds, by hash, the unresolved names unresolved had no room
	// for (or too long to keep), so a resend is not counted again and a
	// removal or a held version clears them; more counts those beyond
	// maxOverflow too.
	overflow map[uint64]bool
	more     int
	fresh    bool
}

type entry struct {
	version string
	value   any
	size    int
}

// New returns a client; Run connects.
func New(cfg Config) (*Client, error) {
	if cfg.Conn == nil {
		return nil, errors.New("xds client: no connection to istiod")
	}
	if err := cfg.Node.validate(); err != nil {
		return nil, err
	}
	cfg.MaxResources = cmp.Or(cfg.MaxResources, DefaultMaxResources)
	cfg.MaxMessageBytes = cmp.Or(cfg.MaxMessageBytes, DefaultMaxMessageBytes)
	cfg.MaxTypeBytes = cmp.Or(cfg.MaxTypeBytes, DefaultMaxTypeBytes)
	cfg.MaxResourceMessages = cmp.Or(cfg.MaxResourceMessages, DefaultMaxResourceMessages)
	cfg.MinBackoff = cmp.Or(cfg.MinBackoff, DefaultMinBackoff)
	cfg.MaxBackoff = max(cmp.Or(cfg.MaxBackoff, DefaultMaxBackoff), cfg.MinBackoff)
	cfg.FirstSyncGrace = cmp.Or(cfg.FirstSyncGrace, DefaultFirstSyncGrace)
	cfg.SilentWarn = cmp.Or(cfg.SilentWarn, DefaultSilentWarn)
	cfg.SnapshotGap = cmp.Or(cfg.SnapshotGap, DefaultSnapshotGap)
	log := cmp.Or(cfg.Logger, slog.Default()).With("source", "xds")
	return &Client{cfg: cfg, log: log, pub: newPublisher(cfg.SnapshotGap), types: []*resourceType{
		{url: TypeAddress, short: "Address", decode: decodeAddress, desc: addressDesc, held: map[string]entry{}},
		{url: TypeAuthorization, short: "Authorization", decode: decodeAuthorization, desc: authorizationDesc, held: map[string]entry{}, unresolved: map[string]bool{}},
	}}, nil
}

func decodeAddress(b []byte) (any, error) {
	var a workloadapi.Address
	if err := proto.Unmarshal(b, &a); err != nil {
		return nil, fmt.Errorf("decode istio.workload.Address: %w", err)
	}
	v, err := translateAddress(&a)
	if err != nil {
		// Held in its place (if the client has no accepted version), its
		// addresses are refused, not reached in plaintext (Rejected).
		if r := rejectedAddress(&a); r != nil {
			return r, err
		}
		return nil, err
	}
	return v, nil
}

func decodeAuthorization(b []byte) (any, error) {
	var a security.Authorization
	if err := proto.Unmarshal(b, &a); err != nil {
		return nil, fmt.Errorf("decode istio.security.Authorization: %w", err)
	}
	p, err := translateAuthorization(&a)
	if err != nil {
		if fc := failClosed(&a); fc != nil {
			return fc, err
		}
		return nil, err
	}
	return p, nil
}

// Run keeps a stream to istiod open until ctx is done, calling update
// with a fresh snapshot after applied responses once the first sync is
// complete, paced (see publisher): a burst of responses makes one
// snapshot. update runs on Run's goroutine and must not keep it long.
// Run returns only ctx's error.
func (c *Client) Run(ctx context.Context, update func(*Snapshot)) error {
	delay := c.cfg.MinBackoff
	for {
		began := time.Now()
		got, err := c.stream(ctx, update)
		c.cfg.Metrics.disconnected()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		c.cfg.Metrics.ended(endReason(got, err))
		if got && time.Since(began) >= c.cfg.MaxBackoff {
			// The stream worked for a while: the next failure starts the
			// backoff anew. A stream that breaks right after its first
			// response does not, or a flapping istiod would draw a
			// reconnect every MinBackoff from every node.
			delay = c.cfg.MinBackoff
		}
		// Up to 50% less than the delay, so agents restarted together
		// spread their reconnects.
		wait := delay - time.Duration(rand.Int64N(int64(delay)/2+1))
		c.log.Warn("xds stream to istiod ended; keeping the last state", "error", err, "retry_in", wait.Round(time.Millisecond))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
		delay = min(delay*2, c.cfg.MaxBackoff)
	}
}

// errStreamClosed: istiod ended the stream cleanly.
var errStreamClosed = errors.New("istiod closed the stream")

// endReason names why a stream ended, as ztunnel counts it.
func endReason(got bool, err error) string {
	switch {
	case !got:
		return endConnectionError
	case errors.Is(err, errStreamClosed):
		return endComplete
	}
	if s, ok := status.FromError(err); ok && err != nil {
		switch s.Code() {
		case codes.Unavailable, codes.Canceled, codes.DeadlineExceeded, codes.Unknown:
			return endReconnect
		}
	}
	return endError
}

// stream runs one stream; got reports whether any response arrived.
func (c *Client) stream(ctx context.Context, update func(*Snapshot)) (got bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// What was applied is delivered before the stream ends.
	defer func() {
		if ctx.Err() == nil {
			c.pub.publish(c.snapshot, update)
		}
	}()
	if c.cfg.Token != nil {
		tok, err := c.cfg.Token()
		if err != nil {
			c.cfg.Metrics.connect(false)
			return false, fmt.Errorf("token for istiod: %w", err)
		}
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	if c.cfg.Node.ClusterID != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, ClusterIDHeader, c.cfg.Node.ClusterID)
	}
	ads := discoveryv3.NewAggregatedDiscoveryServiceClient(c.cfg.Conn)
	st, err := ads.DeltaAggregatedResources(ctx, grpc.MaxCallRecvMsgSize(c.cfg.MaxMessageBytes),
		grpc.ForceCodecV2(responseCodec{CodecV2: encoding.GetCodecV2(grpcproto.Name), max: maxResponseFields(c.cfg.MaxResources)}))
	if err != nil {
		c.cfg.Metrics.connect(false)
		return false, fmt.Errorf("open delta ADS stream: %w", err)
	}
	for i, t := range c.types {
		t.fresh = true
		req := &discoveryv3.DeltaDiscoveryRequest{TypeUrl: t.url, InitialResourceVersions: t.versions()}
		if i == 0 {
			req.Node = c.cfg.Node.proto()
		}
		if err := st.Send(req); err != nil {
			c.cfg.Metrics.connect(false)
			return false, fmt.Errorf("subscribe %s: %w", t.short, err)
		}
	}
	// Recv blocks; the first-sync warning needs a clock beside it.
	type recvd struct {
		resp *discoveryv3.DeltaDiscoveryResponse
		err  error
	}
	ch := make(chan recvd)
	go func() {
		for {
			resp, err := st.Recv()
			select {
			case ch <- recvd{resp, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	var grace <-chan time.Time
	silent := time.NewTimer(c.cfg.SilentWarn)
	defer silent.Stop()
	opened := time.Now()
	for {
		var r recvd
		select {
		case <-ctx.Done():
			return got, ctx.Err()
		case r = <-ch:
		case <-c.pub.C():
			c.pub.publish(c.snapshot, update)
			continue
		case <-silent.C:
			if !got {
				c.log.Warn("istiod accepted the xds stream but has sent no response; keeping the last state and waiting",
					"waited", time.Since(opened).Round(time.Second), "synced_before", c.synced)
			}
			continue
		case <-grace:
			if !c.synced {
				c.log.Warn("istiod sent no response for some types; inbound connections stay refused until it does", "missing", c.missing())
			}
			continue
		}
		if r.err != nil {
			if !got {
				c.cfg.Metrics.connect(false)
			}
			if errors.Is(r.err, io.EOF) {
				return got, errStreamClosed
			}
			return got, fmt.Errorf("receive: %w", r.err)
		}
		if !got {
			got = true
			c.cfg.Metrics.connect(true)
			c.log.Info("xds stream to istiod open", "node_id", c.cfg.Node.ID())
		}
		ack, t := c.apply(r.resp)
		if err := st.Send(ack); err != nil {
			return got, fmt.Errorf("send ack: %w", err)
		}
		if t == nil {
			continue
		}
		switch {
		case c.synced:
			c.pub.changed()
		case c.missing() == "":
			c.synced = true
			c.pub.changed()
		case grace == nil:
			grace = time.After(c.cfg.FirstSyncGrace)
		}
	}
}

// missing names the types that never answered, "" if none.
func (c *Client) missing() string {
	var m []string
	for _, t := range c.types {
		if !t.received {
			m = append(m, t.short)
		}
	}
	return strings.Join(m, ",")
}

// apply applies what of resp can be applied and returns the ACK or NACK,
// and the type it changed (nil for a response of an unknown type).
func (c *Client) apply(resp *discoveryv3.DeltaDiscoveryResponse) (*discoveryv3.DeltaDiscoveryRequest, *resourceType) {
	ack := &discoveryv3.DeltaDiscoveryRequest{TypeUrl: resp.GetTypeUrl(), ResponseNonce: resp.GetNonce()}
	var t *resourceType
	for _, x := range c.types {
		if x.url == resp.GetTypeUrl() {
			t = x
		}
	}
	if t == nil {
		// The type is istiod's text, echoed: clipped like a resource name.
		ack.TypeUrl = clip(resp.GetTypeUrl(), maxErrorBytes/4)
		ack.ErrorDetail = &statuspb.Status{Code: int32(codes.InvalidArgument), Message: "type " + ack.TypeUrl + " was not subscribed"}
		c.log.Warn("xds: NACK", "type", ack.TypeUrl, "error", ack.ErrorDetail.Message)
		return ack, nil
	}
	t.received = true
	size := 0
	for _, r := range resp.GetResources() {
		size += len(r.GetResource().GetValue())
	}
	c.cfg.Metrics.received(t.url, size)
	if t.fresh {
		t.fresh = false
		clear(t.unresolved)
		clear(t.overflow)
		t.more = 0
	}
	var errs []string
	for _, name := range resp.GetRemovedResources() {
		t.bytes -= t.held[name].size
		delete(t.held, name)
		t.resolve(name, true, 0)
	}
	rejected := 0
	for _, r := range resp.GetResources() {
		held, err := c.applyOne(t, r)
		if err != nil {
			if rejected++; len(errs) < maxNackErrors {
				errs = append(errs, clip(r.GetName(), maxErrorBytes/4)+": "+clip(err.Error(), maxErrorBytes))
			}
		}
		t.resolve(cmp.Or(r.GetName(), "(unnamed)"), held || err == nil, min(c.cfg.MaxResources, maxUnresolved))
	}
	c.cfg.Metrics.push(t.short, rejected > 0, len(t.held), t.bytes)
	if t.unresolved != nil {
		c.cfg.Metrics.setUnresolved(t.unresolvedCount())
	}
	if rejected > 0 {
		sort.Strings(errs)
		if rejected > len(errs) {
			errs = append(errs, fmt.Sprintf("and %d more rejected", rejected-len(errs)))
		}
		ack.ErrorDetail = &statuspb.Status{Code: int32(codes.InvalidArgument), Message: strings.Join(errs, "; ")}
		c.log.Warn("xds: NACK; the rest of the response is applied", "type", t.short, "rejected", rejected, "error", ack.ErrorDetail.Message)
	}
	return ack, t
}

// clip cuts s to at most n bytes (on a rune boundary), marking the cut.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + "...(clipped)"
}

// applyOne applies one resource; held reports whether it (or, for a
// policy, its fail-closed form) is now what the client holds under its
// name.
func (c *Client) applyOne(t *resourceType, r *discoveryv3.Resource) (held bool, err error) {
	if r.GetName() == "" {
		c.cfg.Metrics.reject(t.short, rejectInvalid)
		return false, errors.New("resource without a name")
	}
	if len(r.GetName()) > MaxNameBytes || len(r.GetVersion()) > MaxVersionBytes {
		c.cfg.Metrics.reject(t.short, rejectLimit)
		return false, fmt.Errorf("name of %d bytes or version of %d bytes: at most %d and %d", len(r.GetName()), len(r.GetVersion()), MaxNameBytes, MaxVersionBytes)
	}
	if r.GetResource() == nil || r.GetResource().GetTypeUrl() != t.url {
		c.cfg.Metrics.reject(t.short, rejectInvalid)
		return false, fmt.Errorf("want a %s, got %q", t.url, r.GetResource().GetTypeUrl())
	}
	old, had := t.held[r.GetName()]
	if !had && len(t.held) >= c.cfg.MaxResources {
		c.cfg.Metrics.reject(t.short, rejectLimit)
		return false, fmt.Errorf("over the limit of %d %s resources", c.cfg.MaxResources, t.short)
	}
	size, err := charge(r.GetResource().GetValue(), t.desc, c.cfg.MaxResourceMessages)
	// The name and version are held too (and sent back on a reconnect).
	size += len(r.GetName()) + len(r.GetVersion())
	if err != nil {
		var tooMany errTooManyMessages
		if errors.As(err, &tooMany) || errors.As(err, &errTooDeep{}) {
			c.cfg.Metrics.reject(t.short, rejectLimit)
		} else {
			c.cfg.Metrics.reject(t.short, rejectInvalid)
		}
		return false, err
	}
	if t.bytes-old.size+size > c.cfg.MaxTypeBytes {
		c.cfg.Metrics.reject(t.short, rejectLimit)
		return false, fmt.Errorf("over the limit of %d bytes of %s resources (this one is charged %d)", c.cfg.MaxTypeBytes, t.short, size)
	}
	v, err := t.decode(r.GetResource().GetValue())
	if err != nil {
		c.cfg.Metrics.reject(t.short, rejectInvalid)
	}
	if v == nil {
		return false, err
	}
	if want := resourceName(v); want != r.GetName() {
		// Held under a name that is not its own, it would outlive its
		// removal (istiod removes by its own name) and stand beside the
		// resource of that name: two versions of one workload or policy.
		c.cfg.Metrics.reject(t.short, rejectInvalid)
		return false, fmt.Errorf("resource name is not that of its content, %q (istiod names a workload by its uid, a service namespace/hostname, a policy namespace/name)", want)
	}
	if _, standIn := v.(*Rejected); standIn && had {
		if _, was := old.value.(*Rejected); !was {
			// A rejected update of an accepted workload or service: the
			// accepted version stays in force, as in ztunnel.
			return false, err
		}
	}
	// Held even when err is set: a policy that cannot be applied as
	// written is held in its fail-closed form (failClosed), a workload or
	// service rejected with no accepted version as a stand-in refusing
	// its addresses (Rejected).
	t.bytes += size - old.size
	t.held[r.GetName()] = entry{version: r.GetVersion(), value: v, size: size}
	return true, err
}

// resourceName is the name istiod gives the resource v was translated
// from (its ResourceName).
func resourceName(v any) string {
	switch v := v.(type) {
	case *Workload:
		return v.UID
	case *Service:
		return v.Key()
	case *policy.Compiled:
		return v.Key()
	case *Rejected:
		return v.Name
	}
	return ""
}

// resolve records whether the latest version of name was held (see
// resourceType.unresolved); at most limit names are kept, the rest (and
// names over MaxNameBytes) by hash in overflow, and past maxOverflow
// counted.
func (t *resourceType) resolve(name string, held bool, limit int) {
	if t.unresolved == nil {
		return
	}
	h := maphash.String(overflowSeed, name)
	switch {
	case held:
		delete(t.unresolved, name)
		delete(t.overflow, h)
	case t.unresolved[name] || t.overflow[h]:
	case len(t.unresolved) < limit && len(name) <= MaxNameBytes:
		t.unresolved[name] = true
	case len(t.overflow) < maxOverflow:
		if t.overflow == nil {
			t.overflow = map[uint64]bool{}
		}
		t.overflow[h] = true
	default:
		t.more++
	}
}

// overflowSeed seeds the hashes of resourceType.overflow.
var overflowSeed = maphash.MakeSeed()

// unresolvedCount is how many policies are unresolved, named or not.
func (t *resourceType) unresolvedCount() int {
	return len(t.unresolved) + len(t.overflow) + t.more
}

// versions is what a reconnect tells istiod the client already has.
func (t *resourceType) versions() map[string]string {
	if len(t.held) == 0 {
		return nil
	}
	v := make(map[string]string, len(t.held))
	for name, e := range t.held {
		v[name] = e.version
	}
	return v
}

func (c *Client) snapshot() *Snapshot {
	workloads := map[string]*Workload{}
	services := map[string]*Service{}
	policies := map[string]*policy.Compiled{}
	var rejected []*Rejected
	for _, t := range c.types {
		for name, e := range t.held {
			switch v := e.value.(type) {
			case *Workload:
				workloads[name] = v
			case *Service:
				services[name] = v
			case *policy.Compiled:
				policies[name] = v
			case *Rejected:
				if r := v.on(c.cfg.Network); r != nil {
					rejected = append(rejected, r)
				}
			}
		}
	}
	s := buildSnapshot(workloads, services, policies, c.cfg.Network)
	s.Cluster = c.cfg.Node.ClusterID
	slices.SortFunc(rejected, func(a, b *Rejected) int { return cmp.Compare(a.Name, b.Name) })
	s.Rejected = rejected
	c.cfg.Metrics.setOtherNetwork(s.OtherNetwork)
	for _, t := range c.types {
		names := make([]string, 0, len(t.unresolved))
		for name := range t.unresolved {
			names = append(names, name)
		}
		sort.Strings(names)
		more := len(t.overflow) + t.more
		if len(names) > maxListedUnresolved {
			more += len(names) - maxListedUnresolved
			names = names[:maxListedUnresolved]
		}
		s.Unresolved = append(s.Unresolved, names...)
		if more > 0 {
			s.Unresolved = append(s.Unresolved, fmt.Sprintf("(%d more)", more))
		}
	}
	return s
}

// publisher paces snapshots. Building one costs O(all state held)
// (about 0.25 s for 100k workloads) while istiod may send a response per
// change, a few bytes each: built per response, an endless stream of tiny
// updates would keep a core busy rebuilding. Changes are marked instead,
// and a snapshot is built on a timer: at once after a quiet spell, else no
// sooner after the last than the gap and three times what building the
// last took, so a burst makes one snapshot and rebuilding takes at most a
// quarter of a core, however fast responses come. Only Run's goroutine
// uses it.
type publisher struct {
	gap     time.Duration
	timer   *time.Timer
	pending bool
	// next is the earliest time the next snapshot may be built.
	next time.Time
}

func newPublisher(gap time.Duration) *publisher {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &publisher{gap: gap, timer: t}
}

// changed records that the state changed since the last snapshot.
func (p *publisher) changed() {
	if !p.pending {
		p.pending = true
		p.timer.Reset(max(time.Until(p.next), 0))
	}
}

// C fires when a snapshot is due.
func (p *publisher) C() <-chan time.Time { return p.timer.C }

// publish builds a snapshot and hands it to update if a change is pending.
func (p *publisher) publish(build func() *Snapshot, update func(*Snapshot)) {
	if !p.pending {
		return
	}
	p.pending = false
	p.timer.Stop()
	start := time.Now()
	s := build()
	cost := time.Since(start)
	update(s)
	p.next = time.Now().Add(max(p.gap, 3*cost))
}
