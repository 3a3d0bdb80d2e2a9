package kubeobj

import (
	"errors"
	"fmt"

	kjson "sigs.k8s.io/json"
)

// DecodeStrict decodes the JSON data into v as the API server does under
// strict field validation: field names match case-sensitively, and a field
// that v does not have, or that data gives twice, is an error. encoding/json
// matches names in any case and keeps the last of two, so a manifest with
// "hostNetwork: false" and then "hostnetwork: true" would be read as
// hostNetwork, where Kubernetes refuses the second field: what a reader of
// the object sees must be what the agent does.
func DecodeStrict(data []byte, v any) error {
	strict, err := kjson.UnmarshalStrict(data, v)
	if err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	if len(strict) > 0 {
		return fmt.Errorf("strict decoding: %w", errors.Join(strict...))
	}
	return nil
}
