package xds

import (
	"runtime"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"
)

// TestChargeBoundsDecodedElements: a resource is charged before it is
// decoded, and MaxTypeBytes bounds what is charged; but an element of a
// repeated scalar field costs a slice element once decoded (a []byte's
// header is 24 bytes) for as little as one byte on the wire, and was
// charged that byte only. 20M empty addresses in one 40 MB workload
// decoded to half a GiB (a full response to several GiB, past the agent's
// memory limit) before the workload was refused for having more than 16;
// a workload listing millions of empty policy names was held at some five
// times its charge. What decoding a resource costs is now within its
// charge.
func TestChargeBoundsDecodedElements(t *testing.T) {
	const n = 2_000_000
	empties := make([][]byte, n)
	for i := range empties {
		empties[i] = []byte{}
	}
	names := make([]string, n)
	ports := make([]uint32, n)
	for i := range ports {
		ports[i] = 80
	}
	for _, c := range []struct {
		name string
		msg  proto.Message
		desc protoreflect.MessageDescriptor
	}{
		{"empty addresses", &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: &workloadapi.Workload{Uid: "u", Name: "n", Namespace: "ns", Addresses: empties}}}, addressDesc},
		{"empty policy names", &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: &workloadapi.Workload{Uid: "u", Name: "n", Namespace: "ns", AuthorizationPolicies: names}}}, addressDesc},
		{"packed ports", &security.Authorization{Name: "x", Namespace: "y", Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{DestinationPorts: ports}}}}}}}, authorizationDesc},
	} {
		b, err := proto.Marshal(c.msg)
		if err != nil {
			t.Fatal(err)
		}
		charged, err := charge(b, c.desc, DefaultMaxResourceMessages)
		if err != nil {
			t.Fatal(err)
		}
		before := heapInUse()
		m := c.msg.ProtoReflect().New().Interface()
		if err := proto.Unmarshal(b, m); err != nil {
			t.Fatal(err)
		}
		decoded := int(heapInUse() - before)
		runtime.KeepAlive(m)
		if decoded > charged {
			t.Errorf("%s: %d bytes on the wire decode to %d, charged %d (%.1f times less)", c.name, len(b), decoded, charged, float64(decoded)/float64(charged))
		}
	}
}

func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}
