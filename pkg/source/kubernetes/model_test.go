package kubernetes

import (
	"slices"
	"testing"
)

func TestSortedMap(t *testing.T) {
	var m sortedMap[string]
	if got := m.values(); len(got) != 0 {
		t.Fatalf("empty map values = %v", got)
	}
	set := func(ns, name string) { m.set(objKey{ns, name}, ns+"/"+name) }
	// "a-x" sorts after "a" as a namespace, though "a-x/..." sorts before "a/..." as a string.
	set("b", "1")
	set("a-x", "1")
	set("a", "2")
	set("a", "1")
	want := []string{"a/1", "a/2", "a-x/1", "b/1"}
	first := m.values()
	if !slices.Equal(first, want) {
		t.Fatalf("values = %v, want %v", first, want)
	}
	if again := m.values(); &again[0] != &first[0] {
		t.Error("values without a change made a new slice")
	}

	m.set(objKey{"a", "2"}, "a/2'") // a value change keeps the order
	m.delete(objKey{"b", "1"})
	m.delete(objKey{"b", "1"}) // deleting an absent key is a no-op
	set("0", "z")
	m.delete(objKey{"a-x", "1"}) // deleted and added back before values: once
	set("a-x", "1")
	got := m.values()
	if want := []string{"0/z", "a/1", "a/2'", "a-x/1"}; !slices.Equal(got, want) {
		t.Fatalf("values = %v, want %v", got, want)
	}
	if !slices.Equal(first, []string{"a/1", "a/2", "a-x/1", "b/1"}) {
		t.Errorf("an earlier values result changed: %v", first)
	}
}
