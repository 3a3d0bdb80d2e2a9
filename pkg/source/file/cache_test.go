package file

import (
	"reflect"
	"strings"
	"testing"
)

// TestLoadCached: a load given the last load's decoded documents gives the
// same snapshot and errors as a fresh load, reuses the unchanged documents,
// decodes the changed ones, and is not affected by what a consumer did to an
// earlier snapshot.
func TestLoadCached(t *testing.T) {
	dir := t.TempDir()
	path := writeFile(t, dir, "c.yaml", everyKind)
	fresh := func() result {
		t.Helper()
		r, err := load(path, nil)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	same := func(got, want result) {
		t.Helper()
		if !reflect.DeepEqual(got.snap, want.snap) {
			t.Errorf("cached load's snapshot differs from a fresh load's:\n%+v\nwant\n%+v", got.snap, want.snap)
		}
		if !reflect.DeepEqual(errorStrings(got.errs), errorStrings(want.errs)) {
			t.Errorf("cached load's errors %q, a fresh load's %q", errorStrings(got.errs), errorStrings(want.errs))
		}
	}

	r1 := fresh()
	if len(r1.errs) > 0 || len(r1.decoded) == 0 {
		t.Fatalf("errs %v, %d documents cached", r1.errs, len(r1.decoded))
	}
	// A consumer that breaks the read-only contract does not reach the cache.
	r1.snap.Pods[0].Labels["app"] = "changed"
	r1.snap.Pods[0].Status.PodIPs[0].IP = "192.0.2.1"
	r2, err := load(path, r1.decoded)
	if err != nil {
		t.Fatal(err)
	}
	same(r2, fresh())
	for sum, replays := range r1.decoded {
		if got := r2.decoded[sum].replays; len(got) == 0 || &got[0] != &replays.replays[0] {
			t.Errorf("document %x decoded again, not taken from the cache", sum[:4])
		}
	}

	// A changed document is decoded again; the others still come from the cache.
	writeFile(t, dir, "c.yaml", strings.Replace(everyKind, "labels: {app: web}", "labels: {app: shop}", 1))
	r3, err := load(path, r2.decoded)
	if err != nil {
		t.Fatal(err)
	}
	same(r3, fresh())
	if got := r3.snap.Pods[0].Labels["app"]; got != "shop" {
		t.Errorf("changed pod's label app=%q, want shop", got)
	}

	// Checks across documents still run for cached documents: the same pod
	// twice is a duplicate, also when both copies come from the cache.
	pod := "apiVersion: v1\nkind: Pod\nmetadata: {name: a, namespace: x}\n"
	writeFile(t, dir, "c.yaml", pod)
	r4 := fresh()
	writeFile(t, dir, "c.yaml", pod+"---\n"+pod)
	for _, prev := range []docCache{nil, r4.decoded, r4.decoded} {
		r, err := load(path, prev)
		if err != nil {
			t.Fatal(err)
		}
		wantErrs(t, r.errs, path+": document 2 (line 5): duplicate Pod x/a, first defined in "+path+" document 1 (line 1)")
		r4 = r
	}

	// A document with errors is never cached: it fails the same way each time.
	writeFile(t, dir, "c.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {bogus: 1}\n")
	var prev docCache
	for range 2 {
		r := fresh()
		r5, err := load(path, prev)
		if err != nil {
			t.Fatal(err)
		}
		same(r5, r)
		if len(r5.errs) != 1 || len(r5.decoded) != 0 {
			t.Fatalf("errs %v, %d documents cached; want one error, none cached", r5.errs, len(r5.decoded))
		}
		prev = r5.decoded
	}
}

func errorStrings(errs []error) []string {
	var s []string
	for _, err := range errs {
		s = append(s, err.Error())
	}
	return s
}
