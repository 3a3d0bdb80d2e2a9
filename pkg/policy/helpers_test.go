package policy

import (
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// decodeAll decodes "---"-separated YAML documents into T, the way users
// write policies, so the tests also cover the YAML shapes.
func decodeAll[T any](t *testing.T, docs string) []T {
	t.Helper()
	var out []T
	for doc := range strings.SplitSeq(docs, "\n---\n") {
		if strings.TrimSpace(doc) == "" {
			continue
		}
		var v T
		if err := yaml.UnmarshalStrict([]byte(doc), &v); err != nil {
			t.Fatalf("decode %q: %v", doc, err)
		}
		out = append(out, v)
	}
	return out
}
