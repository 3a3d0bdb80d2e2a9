package netnstest

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// TestManifestDamageChangesNothing damages the watched manifest of two running agents the
// way a non-atomic rewrite or a crash does (cut in half, emptied, cut between two documents
// so that the STRICT PeerAuthentication is gone, cut before its last newline; and, before the
// writer ends the file with an end marker, cut right after the PeerAuthentication's "spec:"
// line, which still parses with its mtls gone), each written in place. None of it may be applied: STRICT still refuses a plaintext client, meshed
// traffic still flows, and the agents say why. A good manifest afterwards is picked up.
func TestManifestDamageChangesNothing(t *testing.T) {
	const strict = strictMesh
	ms, client, server, plain := meshed(t, strict)
	holds := func(t *testing.T, when string) {
		t.Helper()
		Eventually(t, 10*time.Second, func() error { _, err := Curl(client, URL(server.IPv4, 8080)); return err })
		if out, err := Curl(plain, URL(server.IPv4, 8080)); err == nil {
			t.Fatalf("%s: a plaintext client reached the STRICT pod: %q", when, out)
		}
	}
	holds(t, "before")

	good, err := os.ReadFile(ms.manifest)
	if err != nil {
		t.Fatal(err)
	}
	count := func(what string) []int {
		var n []int
		for _, a := range ms.agents {
			n = append(n, strings.Count(a.Log(), what))
		}
		return n
	}
	const loaded, refused = "loaded manifests", "manifests not applied"
	// damage writes data in place, not renamed (what a non-atomic writer or a truncation
	// leaves), and checks that each agent refuses it and STRICT still holds.
	damage := func(t *testing.T, name string, data []byte) {
		loads, refusals := count(loaded), count(refused)
		if err := os.WriteFile(ms.manifest, data, 0o644); err != nil {
			t.Fatal(err)
		}
		// Each agent either refuses the file or (wrongly) loads it.
		Eventually(t, 10*time.Second, func() error {
			l, r := count(loaded), count(refused)
			for i := range ms.agents {
				if l[i] == loads[i] && r[i] == refusals[i] {
					return fmt.Errorf("agent %d has not read the damaged manifest yet", i)
				}
			}
			return nil
		})
		time.Sleep(time.Second) // what a wrongly applied snapshot takes to act
		holds(t, name)
		for i, n := range count(refused) {
			if n == refusals[i] {
				t.Errorf("agent %d did not log that it refused the damaged manifest", i)
			}
		}
	}
	// Before the writer uses the end marker: a cut at a line end right after the
	// PeerAuthentication's "spec:" line still parses, its mtls gone (STRICT dropped), unless
	// a last line opening a value that never comes is taken for the cut it is.
	spec := bytes.Index(good, []byte("spec:\n  mtls: {mode: STRICT}"))
	if spec < 0 {
		t.Fatal("no STRICT PeerAuthentication in the manifest")
	}
	t.Run("cut right after a line opening a value, no end marker", func(t *testing.T) {
		damage(t, "cut after spec:", good[:spec+len("spec:\n")])
	})
	writeAtomic(t, ms.manifest, good)

	// The writer of the file ends it with YAML's end marker, so a cut between two documents
	// shows too. Written atomically, as a good writer does; wait until both agents took it.
	ended := append(append([]byte{}, good...), "...\n"...)
	before := count(loaded)
	writeAtomic(t, ms.manifest, ended)
	Eventually(t, 10*time.Second, func() error {
		for i, n := range count(loaded) {
			if n <= before[i] {
				return fmt.Errorf("agent %d has not loaded the manifest with the end marker", i)
			}
		}
		return nil
	})

	half := len(ended) / 2
	for ended[half-1] == '\n' {
		half++ // a cut mid-line
	}
	boundary := bytes.LastIndex(ended, []byte("---\napiVersion: security.istio.io/v1"))
	if boundary < 0 {
		t.Fatal("no PeerAuthentication document in the manifest")
	}
	for _, tc := range []struct {
		name string
		data []byte
	}{
		{"cut in half", ended[:half]},
		{"emptied", nil},
		{"cut between documents, without the PeerAuthentication", ended[:boundary]},
		{"cut before the last newline", ended[:len(ended)-1]},
	} {
		t.Run(tc.name, func(t *testing.T) { damage(t, tc.name, tc.data) })
	}

	// A good manifest is picked up again: PERMISSIVE lets the plaintext client in, then STRICT
	// again keeps it out.
	writeAtomic(t, ms.manifest, bytes.Replace(ended, []byte("mode: STRICT"), []byte("mode: PERMISSIVE"), 1))
	Eventually(t, 10*time.Second, func() error { _, err := Curl(plain, URL(server.IPv4, 8080)); return err })
	writeAtomic(t, ms.manifest, ended)
	WaitRefused(t, plain, URL(server.IPv4, 8080), 10*time.Second)
	holds(t, "restored")
}

func writeAtomic(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path+".tmp", data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}
