package xds

import (
	"fmt"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"
)

// What a held resource is charged against MaxTypeBytes beyond its encoded
// size. An empty nested message is 2 bytes on the wire but a struct of
// hundreds once decoded and translated (a policy.Match is 288), so the
// encoded size alone bounds memory by nothing: each resource is charged
// resourceOverhead and each message in it messageOverhead. Likewise an
// element of a repeated scalar field (a workload's addresses, the policies
// it lists, a match's ports) is a slice element once decoded, up to 24
// bytes (a []byte's header) for as little as one byte on the wire (an
// empty string or address, a port packed in one byte): each string or
// bytes element is charged stringOverhead, each number numberOverhead
// (each with the slack of a grown slice), or 20M empty addresses in one
// 40 MB resource decoded to half a GiB before the workload was refused for
// having more than 16. A typical workload (about 500 bytes, 8 messages, a
// few elements) is charged under 2 KiB, so the default bounds still hold
// 200k of them.
const (
	resourceOverhead = 256
	messageOverhead  = 128
	stringOverhead   = 32
	numberOverhead   = 8
)

var (
	addressDesc       = (&workloadapi.Address{}).ProtoReflect().Descriptor()
	authorizationDesc = (&security.Authorization{}).ProtoReflect().Descriptor()
)

// charge returns what the encoded message b of type md is charged (see
// resourceOverhead), without decoding it, or an error when it holds more
// than limit messages or is malformed. It only walks the wire format, so
// a hostile resource costs no allocation before it is refused.
func charge(b []byte, md protoreflect.MessageDescriptor, limit int) (int, error) {
	n, elems := 0, 0
	if err := countMessages(b, md, &n, &elems, limit); err != nil {
		return 0, err
	}
	return len(b) + resourceOverhead + n*messageOverhead + elems, nil
}

// MaxDepth bounds how deep messages nest in a response, counted on the
// wire before anything is decoded. walkWire recurses per level, some
// hundreds of bytes of stack each: a response of 14 MiB nesting 1.5M
// levels (google.protobuf.Struct, which a Resource's metadata holds,
// nests without end) grew the stack past Go's 1 GB and crashed the agent
// (a fatal error, not a panic), every tunnel with it. 100 is the limit of
// prost, ztunnel's decoder; istiod's resources nest a handful of levels.
const MaxDepth = 100

// errTooDeep is walkWire's error past MaxDepth.
type errTooDeep struct{}

func (errTooDeep) Error() string {
	return fmt.Sprintf("messages nested more than %d deep", MaxDepth)
}

// errTooManyMessages is countMessages' error past the limit.
type errTooManyMessages int

func (e errTooManyMessages) Error() string {
	return fmt.Sprintf("more than %d messages in one resource", int(e))
}

// countMessages adds to n the messages nested in b (md's fields of
// message kind, map entries included; unknown fields are not walked), and
// to elems what the elements of repeated scalar fields are charged.
func countMessages(b []byte, md protoreflect.MessageDescriptor, n, elems *int, limit int) error {
	return walkWire(b, md, func(f wireField) error {
		*elems += f.elems
		if !f.message {
			return nil
		}
		if *n++; *n > limit {
			return errTooManyMessages(limit)
		}
		return nil
	})
}

// wireField is what walkWire reports of a field on the wire: a nested
// message (walked next), or elements of a repeated scalar field (a packed
// one holds many), charged elems (see stringOverhead), or neither.
type wireField struct {
	message bool
	elems   int
}

// scalarElems is what the elements of the repeated scalar field fd in the
// value v of wire type typ are charged: one, or for a packed value all.
func scalarElems(fd protoreflect.FieldDescriptor, typ protowire.Type, v []byte) int {
	switch {
	case fd.Kind() == protoreflect.StringKind || fd.Kind() == protoreflect.BytesKind:
		return stringOverhead
	case typ != protowire.BytesType:
		return numberOverhead
	}
	switch fd.Kind() {
	case protoreflect.Fixed32Kind, protoreflect.Sfixed32Kind, protoreflect.FloatKind:
		return len(v) / 4 * numberOverhead
	case protoreflect.Fixed64Kind, protoreflect.Sfixed64Kind, protoreflect.DoubleKind:
		return len(v) / 8 * numberOverhead
	}
	n := 0 // varints: each ends with a byte under 0x80
	for _, c := range v {
		if c < 0x80 {
			n++
		}
	}
	return n * numberOverhead
}

// walkWire calls count for every field of b (md's message) and, depth
// first, of the messages in it, without decoding anything; unknown fields
// and bytes are not walked. It stops at the first error count or the wire
// format gives, and at messages nested deeper than MaxDepth.
func walkWire(b []byte, md protoreflect.MessageDescriptor, count func(wireField) error) error {
	return walkWireAt(b, md, count, 0)
}

// walkWireAt is walkWire for a message nested depth levels deep.
func walkWireAt(b []byte, md protoreflect.MessageDescriptor, count func(wireField) error, depth int) error {
	if depth > MaxDepth {
		return fmt.Errorf("%s: %w", md.FullName(), errTooDeep{})
	}
	fields := md.Fields()
	for len(b) > 0 {
		num, typ, l := protowire.ConsumeTag(b)
		if l < 0 {
			return fmt.Errorf("malformed %s: %w", md.FullName(), protowire.ParseError(l))
		}
		b = b[l:]
		fd := fields.ByNumber(num)
		if typ == protowire.BytesType && fd != nil && (fd.Kind() == protoreflect.MessageKind || fd.Kind() == protoreflect.GroupKind) {
			v, l := protowire.ConsumeBytes(b)
			if l < 0 {
				return fmt.Errorf("malformed %s.%s: %w", md.FullName(), fd.Name(), protowire.ParseError(l))
			}
			if err := count(wireField{message: true}); err != nil {
				return err
			}
			if err := walkWireAt(v, fd.Message(), count, depth+1); err != nil {
				return err
			}
			b = b[l:]
			continue
		}
		l = protowire.ConsumeFieldValue(num, typ, b)
		if l < 0 {
			return fmt.Errorf("malformed %s: %w", md.FullName(), protowire.ParseError(l))
		}
		f := wireField{}
		if fd != nil && fd.IsList() {
			v := b[:l]
			if typ == protowire.BytesType {
				v, _ = protowire.ConsumeBytes(v)
			}
			f.elems = scalarElems(fd, typ, v)
		}
		if err := count(f); err != nil {
			return err
		}
		b = b[l:]
	}
	return nil
}

// responseCodec is gRPC's proto codec with one check before a delta
// response is decoded: its fields, counted on the wire, are at most max.
// What gRPC decodes is past any bound of the client's: a removal of one
// byte on the wire is a string of 16 and more in memory, an empty resource
// a struct of a hundred, so a response of MaxMessageBytes of them decoded
// to some 30 times that (16 MiB of removals, 0.5 GiB) before a resource
// was counted.
type responseCodec struct {
	encoding.CodecV2
	max int
}

func (c responseCodec) Unmarshal(data mem.BufferSlice, v any) error {
	resp, ok := v.(*discoveryv3.DeltaDiscoveryResponse)
	if !ok {
		return c.CodecV2.Unmarshal(data, v)
	}
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	b := buf.ReadOnlyData()
	n := 0
	if err := countFields(b, resp.ProtoReflect().Descriptor(), &n, c.max); err != nil {
		return fmt.Errorf("delta response: %w", err)
	}
	return proto.Unmarshal(b, resp)
}

// maxResponseFields bounds the fields of one response for a client
// holding at most maxResources of a type: a resource is about six on the
// wire (itself, name, version, the Any and its type and value), a removal
// one.
func maxResponseFields(maxResources int) int { return 8*maxResources + 1024 }

// countFields adds to n every field in b (md's message), and those of the
// messages in it; unknown fields and bytes are not walked.
func countFields(b []byte, md protoreflect.MessageDescriptor, n *int, limit int) error {
	return walkWire(b, md, func(wireField) error {
		if *n++; *n > limit {
			return fmt.Errorf("more than %d fields in one response", limit)
		}
		return nil
	})
}
