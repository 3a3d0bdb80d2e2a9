package xds

import (
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/structpb"
)

// nestedValues encodes a google.protobuf.Value holding depth ListValues
// nested in one another, outside in with the sizes computed first
// (appending inside out is quadratic).
func nestedValues(depth int) []byte {
	sizes := make([]int, depth) // of the Value at each level, 0 innermost
	inner := 0
	for i := range depth {
		lv := 1 + protowire.SizeVarint(uint64(inner)) + inner
		inner = 1 + protowire.SizeVarint(uint64(lv)) + lv
		sizes[i] = inner
	}
	b := make([]byte, 0, inner)
	for i := depth - 1; i >= 0; i-- {
		in := 0
		if i > 0 {
			in = sizes[i-1]
		}
		b = protowire.AppendTag(b, 6, protowire.BytesType) // Value.list_value
		b = protowire.AppendVarint(b, uint64(1+protowire.SizeVarint(uint64(in))+in))
		b = protowire.AppendTag(b, 1, protowire.BytesType) // ListValue.values
		b = protowire.AppendVarint(b, uint64(in))
	}
	return b
}

// deepResponse encodes a delta response whose one resource's metadata
// nests depth Values: Resource.metadata.filter_metadata["a"] is a Struct
// whose field "a" is nestedValues(depth).
func deepResponse(depth int) []byte {
	msg := func(num protowire.Number, parts ...[]byte) []byte {
		var v []byte
		for _, p := range parts {
			v = append(v, p...)
		}
		b := protowire.AppendTag(nil, num, protowire.BytesType)
		return protowire.AppendBytes(b, v)
	}
	key := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "a")
	structure := msg(1, key, msg(2, nestedValues(depth))) // Struct.fields["a"]
	metadata := msg(1, key, msg(2, structure))            // Metadata.filter_metadata["a"]
	return msg(2, msg(9, metadata))                       // DeltaDiscoveryResponse.resources[0].metadata
}

// TestResponseDepthBounded: the check that counts a response's fields
// before gRPC decodes it walked nested messages by recursion with no
// bound on the depth. google.protobuf.Struct, which a resource's metadata
// holds, nests without end, and a 14 MiB response nesting 1.5M levels
// (under the 200 MiB a response may be) grew the stack past Go's 1 GB:
// a fatal error, not a panic, which ended the agent and every tunnel it
// served. A response nesting deeper than MaxDepth is now refused before
// it is decoded, as ztunnel's decoder refuses it.
func TestResponseDepthBounded(t *testing.T) {
	c := responseCodec{CodecV2: encoding.GetCodecV2(grpcproto.Name), max: maxResponseFields(DefaultMaxResources)}
	unmarshal := func(b []byte) error {
		var r discoveryv3.DeltaDiscoveryResponse
		return c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, &r)
	}
	// Each level of nestedValues is two messages (Value, ListValue), below
	// four (Resource, Metadata, its entry, Struct, its entry).
	if err := unmarshal(deepResponse(MaxDepth/2 - 5)); err != nil {
		t.Fatalf("a response nesting %d levels: %v", MaxDepth/2-5, err)
	}
	for _, depth := range []int{MaxDepth/2 + 1, 1_500_000} {
		if err := unmarshal(deepResponse(depth)); err == nil || !strings.Contains(err.Error(), "nested more than") {
			t.Fatalf("a response nesting %d levels: %v, want it refused for its depth", depth, err)
		}
	}
}

// TestClientDeepResponseKeepsState: a response refused for its depth ends
// the stream, with the reason logged and counted; what was applied stays,
// and the client reconnects.
func TestClientDeepResponseKeepsState(t *testing.T) {
	h := startClient(t, nil)
	st, _ := h.accept()
	send(t, st, TypeAddress, "n1", nil, resource(t, "a", "v1", TypeAddress, wlAddr("a", "a", "10.1.0.5", nil)))
	send(t, st, TypeAuthorization, "n2", nil)
	if s := h.next(); len(s.Workloads) != 1 {
		t.Fatalf("%d workloads", len(s.Workloads))
	}
	v := structpb.NewStringValue("x")
	for range MaxDepth + 10 {
		v = structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{v}})
	}
	r := resource(t, "b", "v1", TypeAddress, wlAddr("b", "b", "10.1.0.6", nil))
	r.Metadata = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"a": {Fields: map[string]*structpb.Value{"a": v}}}}
	if err := st.Send(&discoveryv3.DeltaDiscoveryResponse{TypeUrl: TypeAddress, Nonce: "n3", Resources: []*discoveryv3.Resource{r}}); err != nil {
		t.Fatal(err)
	}
	st, subs := h.accept()
	if got := subs[0].GetInitialResourceVersions(); len(got) != 1 || got["a"] != "v1" {
		t.Fatalf("initial_resource_versions %v, want a at v1 only", got)
	}
	expectMetric(t, h.metrics, `redirector_xds_connects_total{result="ok"}`, 1)
	send(t, st, TypeAddress, "n4", nil)
	if s := h.next(); len(s.Workloads) != 1 || s.Workloads[0].Name != "a" {
		t.Fatalf("after the refused response: %d workloads", len(s.Workloads))
	}
}
