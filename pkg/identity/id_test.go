package identity

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

func TestParseIDValid(t *testing.T) {
	for _, s := range []string{
		"spiffe://cluster.local/ns/default/sa/web",
		"spiffe://example.org/ns/kube-system/sa/coredns",
		"spiffe://td_1.example-2/ns/a/sa/b.c",
	} {
		id, err := ParseID(s)
		if err != nil {
			t.Errorf("ParseID(%q): %v", s, err)
			continue
		}
		if got := id.String(); got != s {
			t.Errorf("ParseID(%q).String() = %q", s, got)
		}
	}
	id, _ := ParseID("spiffe://cluster.local/ns/default/sa/web")
	want := ID{TrustDomain: "cluster.local", Namespace: "default", ServiceAccount: "web"}
	if id != want {
		t.Errorf("ParseID = %+v, want %+v", id, want)
	}
	if got := id.Principal(); got != "cluster.local/ns/default/sa/web" {
		t.Errorf("Principal() = %q", got)
	}
}

func TestParseIDInvalid(t *testing.T) {
	for _, tc := range []struct{ in, wantMsg string }{
		{"", "must start with"},
		{"cluster.local/ns/a/sa/b", "must start with"},
		{"SPIFFE://cluster.local/ns/a/sa/b", "must start with"},
		{"https://cluster.local/ns/a/sa/b", "must start with"},
		{"spiffe://cluster.local", "no path"},
		{"spiffe:///ns/a/sa/b", "trust domain is empty"},
		{"spiffe://Cluster.Local/ns/a/sa/b", `"Cluster.Local"`},
		{"spiffe://cluster.local:443/ns/a/sa/b", `"cluster.local:443"`},
		{"spiffe://user@cluster.local/ns/a/sa/b", `"user@cluster.local"`},
		{"spiffe://cluster..local/ns/a/sa/b", "empty label"},
		{"spiffe://cluster.local/", "path must be"},
		{"spiffe://cluster.local/ns/a/sa/b/", "path must be"},
		{"spiffe://cluster.local/ns/a/sa", "path must be"},
		{"spiffe://cluster.local/ns/a/sa/b/c", "path must be"},
		{"spiffe://cluster.local/sa/b/ns/a", "path must be"},
		{"spiffe://cluster.local/ns//sa/b", "namespace is empty"},
		{"spiffe://cluster.local/ns/a/sa/", "service account is empty"},
		{"spiffe://cluster.local/ns/../sa/b", "dot segment"},
		{"spiffe://cluster.local/ns/a/sa/b%2Fc", "not a letter"},
		{"spiffe://cluster.local/ns/a/sa/b?x=1", "not a letter"},
		{"spiffe://cluster.local/ns/a/sa/b#frag", "not a letter"},
	} {
		_, err := ParseID(tc.in)
		if err == nil {
			t.Errorf("ParseID(%q) succeeded, want error", tc.in)
			continue
		}
		if !errors.Is(err, ErrInvalidID) {
			t.Errorf("ParseID(%q) error %v does not wrap ErrInvalidID", tc.in, err)
		}
		if !strings.Contains(err.Error(), tc.wantMsg) {
			t.Errorf("ParseID(%q) error %q does not mention %q", tc.in, err, tc.wantMsg)
		}
	}
}

func TestValidateTrustDomain(t *testing.T) {
	for _, td := range []string{"cluster.local", "example.org", "td", "a-b_c.d0"} {
		if err := ValidateTrustDomain(td); err != nil {
			t.Errorf("ValidateTrustDomain(%q): %v", td, err)
		}
	}
	for _, td := range []string{"", "Cluster.local", "a b", ".a", "a.", "a..b", "a/b", strings.Repeat("a", 256)} {
		err := ValidateTrustDomain(td)
		if err == nil {
			t.Errorf("ValidateTrustDomain(%q) succeeded, want error", td)
			continue
		}
		if td != "" && !strings.Contains(err.Error(), td) {
			t.Errorf("ValidateTrustDomain(%q) error %q does not name the value", td, err)
		}
	}
}

func TestIDJSON(t *testing.T) {
	id := ID{TrustDomain: "cluster.local", Namespace: "a", ServiceAccount: "b"}
	b, err := json.Marshal(map[string]ID{"x": id})
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != `{"x":"spiffe://cluster.local/ns/a/sa/b"}` {
		t.Errorf("json = %s", b)
	}
	var back map[string]ID
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if back["x"] != id {
		t.Errorf("round trip = %+v, want %+v", back["x"], id)
	}
	if err := json.Unmarshal([]byte(`"spiffe://cluster.local/ns/a"`), &id); !errors.Is(err, ErrInvalidID) {
		t.Errorf("unmarshal of a bad id: err = %v, want ErrInvalidID", err)
	}
}

// TestIDLengthLimit: an ID longer than the SPIFFE limit is refused both
// when read and when built, and the error does not repeat all of it.
func TestIDLengthLimit(t *testing.T) {
	prefix := "spiffe://cluster.local/ns/a/sa/"
	fits := prefix + strings.Repeat("b", MaxIDLen-len(prefix))
	if _, err := ParseID(fits); err != nil {
		t.Errorf("ParseID of %d bytes: %v", len(fits), err)
	}
	long := fits + "b"
	_, err := ParseID(long)
	if !errors.Is(err, ErrInvalidID) || !strings.Contains(err.Error(), "longer than") {
		t.Fatalf("ParseID of %d bytes: err = %v, want ErrInvalidID naming the limit", len(long), err)
	}
	if len(err.Error()) > 256 {
		t.Errorf("error of %d bytes repeats the ID", len(err.Error()))
	}
	id := ID{TrustDomain: "cluster.local", Namespace: "a", ServiceAccount: strings.Repeat("b", MaxIDLen)}
	if err := id.Validate(); !errors.Is(err, ErrInvalidID) {
		t.Errorf("Validate of a %d-byte ID: err = %v, want ErrInvalidID", len(id.String()), err)
	}
}
